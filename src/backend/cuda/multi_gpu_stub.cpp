// The multi-GPU entry points for builds without CUDA: each one says so.
#ifndef FLASHMOE_HAVE_CUDA
#include "backend/cuda/multi_gpu.h"

#include "core/error.h"

namespace flashmoe {

namespace {
[[noreturn]] void no_cuda() { fail_device(DeviceFailure::Unavailable, "--gpus: this build has no CUDA backend"); }
}  // namespace

struct CudaMultiModel::Impl {};

bool CudaMultiModel::built_with_nccl() { return false; }
std::string CudaMultiModel::nccl_version() { return "this build has no CUDA backend"; }
int CudaMultiModel::device_count() { return 0; }
CudaMultiModel::CudaMultiModel() = default;
CudaMultiModel::~CudaMultiModel() = default;
std::unique_ptr<CudaMultiModel> CudaMultiModel::upload(const QwenModel&, const CudaOptions&, const std::vector<int>&,
                                                       const std::vector<std::vector<int>>&) {
  no_cuda();
}
std::unique_ptr<CudaMultiModel> CudaMultiModel::synthetic(const ModelConfig&, uint64_t, const CudaOptions&,
                                                          const CudaSyntheticOptions&, const std::vector<int>&) {
  no_cuda();
}
int CudaMultiModel::ranks() const { no_cuda(); }
const ModelConfig& CudaMultiModel::config() const { no_cuda(); }
std::string CudaMultiModel::device_name() const { no_cuda(); }
int64_t CudaMultiModel::weight_bytes_total() const { no_cuda(); }
int64_t CudaMultiModel::weight_bytes_per_token() const { no_cuda(); }
const CudaModel& CudaMultiModel::rank_model(int) const { no_cuda(); }
const std::vector<int>& CudaMultiModel::owner(int) const { no_cuda(); }
std::unique_ptr<CudaMultiState> CudaMultiModel::new_state(const KvConfig&) const { no_cuda(); }
CudaStateImage CudaMultiModel::save_state(const CudaMultiState&) const { no_cuda(); }
std::unique_ptr<CudaMultiState> CudaMultiModel::load_state(const CudaStateImage&) const { no_cuda(); }
std::vector<int64_t> CudaMultiModel::kv_positions(const CudaMultiState&, int) const { no_cuda(); }
void CudaMultiModel::forward(CudaMultiState&, const int32_t*, int64_t, LogitsMode, float*) const { no_cuda(); }
void CudaMultiModel::decode_greedy(CudaMultiState&, int32_t, int64_t, int32_t*) const { no_cuda(); }
void CudaMultiModel::set_use_graph(bool) { no_cuda(); }

}  // namespace flashmoe
#endif
