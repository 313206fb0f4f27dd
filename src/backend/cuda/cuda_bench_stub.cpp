// The CUDA backend's benchmark entry points for builds without CUDA.
#ifndef FLASHMOE_HAVE_CUDA
#include "backend/cuda/cuda_bench.h"

#include "core/error.h"

namespace flashmoe {

namespace {
[[noreturn]] void no_cuda() { fail_device(DeviceFailure::Unavailable, "this build has no CUDA backend"); }
}  // namespace

std::unique_ptr<CudaModel> cuda_synthetic_model(const ModelConfig&, uint64_t, const CudaOptions&,
                                                const CudaSyntheticOptions&) {
  no_cuda();
}
void cuda_set_batch_graph(CudaModel&, bool) { no_cuda(); }
void cuda_set_batch_experts(CudaModel&, DecodeOptions::BatchExperts) { no_cuda(); }
double cuda_copy_bandwidth_gbps(const CudaModel&) { no_cuda(); }
double cuda_host_link_gbps(const CudaModel&) { no_cuda(); }
std::string cuda_link_rates(const CudaModel&) { no_cuda(); }
bool cuda_set_host_copies(CudaModel&, bool, int, bool) { no_cuda(); }
std::vector<CudaKernelTime> cuda_profile_decode(const CudaModel&, CudaState&, int32_t, int) { no_cuda(); }

}  // namespace flashmoe
#endif
