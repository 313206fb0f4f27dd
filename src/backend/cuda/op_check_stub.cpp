// The op checks for builds without CUDA: each one says so.
#ifndef FLASHMOE_HAVE_CUDA
#include "backend/cuda/op_check.h"

#include "core/error.h"

namespace flashmoe::cuda_ops {

namespace {
[[noreturn]] void no_cuda() { fail_device(DeviceFailure::Unavailable, "this build has no CUDA backend"); }
}  // namespace

std::vector<float> matvec(const Matrix&, const std::vector<float>&, const std::vector<float>&, float, bool) {
  no_cuda();
}
void topk(const std::vector<float>&, int, int, bool, bool, std::vector<int>*, std::vector<float>*) { no_cuda(); }
std::vector<float> delta_step(DeltaStep&, bool) { no_cuda(); }
std::vector<float> attention(const AttnDecode&, int, bool) { no_cuda(); }
std::vector<float> quant_experts(const std::vector<QuantExpert>&, const std::vector<float>&, const std::vector<float>&,
                                 const std::vector<float>&, float, const QuantExpert*) {
  no_cuda();
}

std::vector<float> gguf_matvec(const Matrix&, const std::vector<float>&, bool) { no_cuda(); }
std::vector<float> gguf_experts(const std::vector<GgufExpert>&, const std::vector<float>&, int,
                                const std::vector<float>&, const std::vector<float>&, float, std::vector<int>*,
                                std::vector<float>*, bool, const GgufExpert*, bool) {
  no_cuda();
}
std::vector<float> gguf_gemm(const Matrix&, const std::vector<float>&, int, int, bool) { no_cuda(); }
std::vector<float> gguf_dense_matvec(const std::vector<Matrix>&, const std::vector<float>&, const std::vector<float>&,
                                     float, const std::vector<float>&) {
  no_cuda();
}
std::vector<float> few_rows_experts(const std::vector<DenseExpert>&, const std::vector<float>&, int,
                                    const std::vector<int>&, int) {
  no_cuda();
}

std::vector<float> skinny_gemm(const Matrix&, const std::vector<float>&, int, int, const std::vector<float>&) {
  no_cuda();
}
std::vector<float> skinny_gemm_split(const Matrix&, const std::vector<float>&, int, int, const std::vector<float>&,
                                     std::vector<uint16_t>&, std::vector<uint16_t>&) {
  no_cuda();
}

}  // namespace flashmoe::cuda_ops
#endif
