// The CUDA backend's entry points for builds without CUDA: each one says so.
#ifndef FLASHMOE_HAVE_CUDA
#include "backend/cuda/cuda_model.h"

#include "core/error.h"

namespace flashmoe {

namespace {
[[noreturn]] void no_cuda() { fail_device(DeviceFailure::Unavailable, "this build has no CUDA backend"); }
}  // namespace

struct CudaState::Impl {};
struct CudaModel::Impl {};

CudaState::~CudaState() = default;
int64_t CudaState::position() const { no_cuda(); }

bool CudaModel::available(std::string* why, bool* too_old) {
  if (why) *why = "this build has no CUDA backend";
  if (too_old) *too_old = false;
  return false;
}
bool CudaModel::memory_info(int64_t*, int64_t*) { return false; }
CudaModel::CudaModel() = default;
CudaModel::~CudaModel() = default;
std::unique_ptr<CudaModel> CudaModel::upload(const QwenModel&, const CudaOptions&) { no_cuda(); }
const ModelConfig& CudaModel::config() const { no_cuda(); }
std::string CudaModel::device_name() const { no_cuda(); }
int64_t CudaModel::weight_bytes_total() const { no_cuda(); }
int64_t CudaModel::weight_bytes_per_token() const { no_cuda(); }
std::unique_ptr<CudaState> CudaModel::new_state(const KvConfig&, bool) const { no_cuda(); }
void CudaModel::release_state(std::unique_ptr<CudaState>) const noexcept {}
size_t CudaModel::free_states() const { return 0; }
bool CudaModel::has_mtp() const { no_cuda(); }
void CudaModel::draft(CudaState&, int32_t, int64_t, const CudaDraftPicker&, int32_t*) const { no_cuda(); }
CudaStateImage CudaModel::save_state(const CudaState&) const { no_cuda(); }
std::unique_ptr<CudaState> CudaModel::load_state(const CudaStateImage&) const { no_cuda(); }
CudaDeviceImage::~CudaDeviceImage() = default;
std::unique_ptr<CudaDeviceImage> CudaModel::save_state_device(const CudaState&) const { no_cuda(); }
size_t CudaModel::state_image_bytes(const CudaState&) const { no_cuda(); }
void CudaModel::vram(int64_t*, int64_t*) const { no_cuda(); }
std::unique_ptr<CudaState> CudaModel::load_state(const CudaDeviceImage&) const { no_cuda(); }
CudaStateImage CudaModel::download(const CudaDeviceImage&) const { no_cuda(); }
void CudaModel::mark_rollback(CudaState&) const { no_cuda(); }
void CudaModel::rollback(CudaState&) const { no_cuda(); }
int64_t CudaModel::rollback_position(const CudaState&) const { no_cuda(); }
bool CudaModel::take_back(CudaState&, int64_t) const { no_cuda(); }
bool CudaModel::keeps_rows(CudaState&, int64_t) const { no_cuda(); }
std::vector<int64_t> CudaModel::kv_positions(const CudaState&, int) const { no_cuda(); }
std::vector<int64_t> CudaModel::kv_selected(const CudaState&, int, int) const { no_cuda(); }
void CudaModel::forward(CudaState&, const int32_t*, int64_t, LogitsMode, float*) const { no_cuda(); }
void CudaModel::decode_greedy(CudaState&, int32_t, int64_t, int32_t*) const { no_cuda(); }
void CudaModel::forward_argmax_rows(CudaState&, const int32_t*, int64_t, int32_t*) const { no_cuda(); }
void CudaModel::forward_batch(const CudaBatchItem*, int64_t) const { no_cuda(); }
void CudaModel::set_use_graph(bool) { no_cuda(); }
CudaTierStats CudaModel::tier_stats() const { no_cuda(); }
void CudaModel::reset_tier_stats() { no_cuda(); }

}  // namespace flashmoe
#endif
