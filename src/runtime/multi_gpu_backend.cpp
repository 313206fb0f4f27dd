#include "runtime/multi_gpu_backend.h"

#include <algorithm>
#include <mutex>
#include <string>

#include "core/error.h"
#include "kv/memory_calc.h"
#include "runtime/cuda_backend_impl.h"

namespace flashmoe {

namespace {

class MultiGpuSnapshot final : public StateSnapshot {
 public:
  explicit MultiGpuSnapshot(CudaStateImage img) : image(std::move(img)) {}
  int64_t position() const override { return image.pos; }
  size_t bytes() const override { return image.bytes(); }
  CudaStateImage image;
};

class MultiGpuState final : public State {
 public:
  MultiGpuState(const MultiGpuBackend& b, const KvConfig& kv) : b_(b), kv_(kv) {
    std::lock_guard<FifoMutex> g(b_.call_lock());
    st = b_.device().new_state(kv);
  }
  ~MultiGpuState() override {
    std::lock_guard<FifoMutex> g(b_.call_lock());
    st.reset();
  }
  int64_t position() const override { return st->position(); }
  // Per GPU: every rank holds the same KV cache and recurrent states.
  StateBytes bytes() const override {
    const ModelConfig& c = b_.config();
    return {kv_cache_bytes(c, kv_, position()), kv_memory(c, kv_).constant_bytes()};
  }
  std::unique_ptr<StateSnapshot> snapshot() const override {
    std::lock_guard<FifoMutex> g(b_.call_lock());
    return std::make_unique<MultiGpuSnapshot>(b_.device().save_state(*st));
  }
  void restore(const StateSnapshot& snap) override {
    const auto* s = dynamic_cast<const MultiGpuSnapshot*>(&snap);
    if (!s) fail("state snapshot: taken on another device");
    if (s->image.kv.describe() != kv_.describe()) fail("state snapshot: taken with another KV configuration");
    std::lock_guard<FifoMutex> g(b_.call_lock());
    st.reset();
    st = b_.device().load_state(s->image);
  }
  std::vector<int64_t> kv_positions(int layer) const override {
    std::lock_guard<FifoMutex> g(b_.call_lock());
    return b_.device().kv_positions(*st, layer);
  }
  std::unique_ptr<CudaMultiState> st;

 private:
  const MultiGpuBackend& b_;
  KvConfig kv_;
};

MultiGpuState& multi_state(State& st) {
  auto* s = dynamic_cast<MultiGpuState*>(&st);
  if (!s) fail("multi-GPU backend: the state belongs to another device");
  return *s;
}

}  // namespace

MultiGpuBackend::MultiGpuBackend(std::shared_ptr<const QwenModel> host, std::unique_ptr<CudaMultiModel> device)
    : host_(std::move(host)), device_(std::move(device)) {}
MultiGpuBackend::~MultiGpuBackend() = default;

std::string MultiGpuBackend::device_name() const { return device_->device_name(); }
const ModelConfig& MultiGpuBackend::config() const { return device_->config(); }
const QwenModel& MultiGpuBackend::model() const {
  if (!host_) fail("this model was built on the GPU (synthetic): it has no host weights");
  return *host_;
}

std::unique_ptr<State> MultiGpuBackend::new_state(const KvConfig& kv) const {
  return std::make_unique<MultiGpuState>(*this, kv);
}

void MultiGpuBackend::forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                              ThreadPool&) const {
  MultiGpuState& s = multi_state(st);
  std::lock_guard<FifoMutex> g(lock_);
  device_->forward(*s.st, ids, n, mode, logits);
}

void MultiGpuBackend::greedy(State& st, int32_t first, int64_t n, int32_t* out, ThreadPool&) const {
  MultiGpuState& s = multi_state(st);
  std::lock_guard<FifoMutex> g(lock_);
  device_->decode_greedy(*s.st, first, n, out);
}

int64_t MultiGpuBackend::weight_bytes_total() const { return device_->weight_bytes_total(); }
int64_t MultiGpuBackend::weight_bytes_per_token() const { return device_->weight_bytes_per_token(); }

std::string MultiGpuBackend::expert_stats(int64_t) const {
  const CudaMultiModel& m = *device_;
  std::vector<int> count(size_t(m.ranks()), 0);
  const std::vector<bool>& moe = m.config().layer_is_moe;
  if (m.config().num_experts > 0 && std::find(moe.begin(), moe.end(), true) != moe.end())
    for (int o : m.owner(0)) ++count[size_t(o)];
  std::string s = "expert parallel over " + std::to_string(m.ranks()) + " GPUs; routed experts per GPU (first MoE layer):";
  for (int r = 0; r < m.ranks(); ++r) {
    s += ' ';
    s += std::to_string(count[size_t(r)]);
  }
  return s;
}

void check_gpu_list(const GpuOptions& o) {
  if (o.devices.empty()) return;
  if (!CudaMultiModel::built_with_nccl())
    fail_device(DeviceFailure::Unavailable, "--gpus: " + CudaMultiModel::nccl_version());
  const int n = CudaMultiModel::device_count();
  for (int d : o.devices)
    if (d >= n)
      fail("--gpus: GPU " + std::to_string(d) + " is not there (" + std::to_string(n) + " usable GPU" +
           (n == 1 ? "" : "s") + " visible)");
  if (o.expert_cache_gb >= 0 || o.expert_cache_fraction >= 0 || o.host_cache_gb >= 0 || o.host_cache_fraction >= 0)
    fail("--gpus: every routed expert is in VRAM on several GPUs; --gpu-expert-cache / --gpu-host-cache are "
         "for one GPU");
}

std::unique_ptr<Backend> make_multi_gpu_backend(std::shared_ptr<const QwenModel> model, const GpuOptions& o) {
  check_gpu_list(o);
  std::unique_ptr<CudaMultiModel> device = CudaMultiModel::upload(*model, cuda_options(o), o.devices);
  return std::make_unique<MultiGpuBackend>(std::move(model), std::move(device));
}

}  // namespace flashmoe
