#include "runtime/cuda_backend.h"

#include <algorithm>
#include <cstdio>
#include <list>
#include <optional>
#include <string>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "core/error.h"
#include "core/fifo_mutex.h"
#include "kv/memory_calc.h"
#include "runtime/cuda_backend_impl.h"
#include "runtime/memory_plan.h"

namespace flashmoe {

namespace {
// Holds the backend's call lock for a scope.
struct CallGuard {
  explicit CallGuard(FifoMutex& m) : m_(m) { m_.lock(); }
  ~CallGuard() { m_.unlock(); }
  FifoMutex& m_;
};
}  // namespace

// A conversation snapshot, in VRAM (a device-to-device copy queued on the
// model's stream: taking it holds the call lock for microseconds, where a
// download of a ~60 MB state into pageable host memory held it, and so
// every batched step, for milliseconds) or in host memory (over the VRAM
// budget, or moved there when newer ones needed the room). Where it lives
// changes only under the call lock; its position and bytes never change.
class CudaSnapshot final : public StateSnapshot {
 public:
  explicit CudaSnapshot(CudaStateImage img)
      : kv(img.kv), drafting(img.drafting), pos_(img.pos), bytes_(img.bytes()), host(std::move(img)) {}
  // In VRAM: registered as the most recently used (caller holds the call lock).
  CudaSnapshot(const CudaBackend& b, std::unique_ptr<CudaDeviceImage> d);
  ~CudaSnapshot() override;
  int64_t position() const override { return pos_; }
  size_t bytes() const override { return bytes_; }  // VRAM or host memory, wherever it is
  const KvConfig kv;
  const bool drafting;

 private:
  const int64_t pos_;
  const size_t bytes_;

 public:
  const CudaBackend* const owner_ = nullptr;  // taken into VRAM by this backend
  // Under the owner's call lock:
  std::unique_ptr<CudaDeviceImage> device_;  // null: in `host`
  CudaStateImage host;
  std::list<CudaSnapshot*>::iterator where_;  // in the owner's use order while in VRAM
};

struct CudaBackend::SnapshotVram {
  // Free VRAM a snapshot may not take: the memory plan's 4 GiB margin and as
  // much again for KV caches that grow and the prefill's scratch.
  static constexpr int64_t kReserve = int64_t(8) << 30;
  bool sized = false;
  size_t budget = 0, held = 0;
  std::list<CudaSnapshot*> lru;  // front: the most recently taken or restored

  // The default budget, at first use.
  void size_once(const CudaModel& m) {
    if (sized) return;
    sized = true;
    int64_t free = 0, total = 0;
    m.vram(&free, &total);
    budget = size_t(total / 8);
  }
  void add(CudaSnapshot& s) {
    lru.push_front(&s);
    s.where_ = lru.begin();
    held += s.bytes();
  }
  void touch(CudaSnapshot& s) { lru.splice(lru.begin(), lru, s.where_); }
  void drop(CudaSnapshot& s) {
    lru.erase(s.where_);
    held -= s.bytes();
    s.device_.reset();  // cudaFree: the device is idle under the call lock
  }
  // Moves the least recently used ones to host memory until `need` more
  // bytes fit. The download waits for the device: this is the one case where
  // a snapshot costs the steps a copy to the host (past the budget).
  void make_room(const CudaModel& m, size_t need) {
    while (held + need > budget && !lru.empty()) {
      CudaSnapshot& s = *lru.back();
      s.host = m.download(*s.device_);
      drop(s);
    }
  }
};

CudaSnapshot::CudaSnapshot(const CudaBackend& b, std::unique_ptr<CudaDeviceImage> d)
    : kv(d->kv), drafting(d->drafting), pos_(d->pos), bytes_(d->bytes()), owner_(&b), device_(std::move(d)) {
  b.snapshot_vram().add(*this);
}

CudaSnapshot::~CudaSnapshot() {
  if (!owner_) return;
  CallGuard g(owner_->call_lock());
  if (device_) owner_->snapshot_vram().drop(*this);
}

namespace {

// A restore point kept on the device (CudaModel::mark_rollback): valid for
// the state that made it, until its next one.
class CudaRollbackPoint final : public StateSnapshot {
 public:
  CudaRollbackPoint(const void* owner, int64_t pos) : owner(owner), pos(pos) {}
  int64_t position() const override { return pos; }
  size_t bytes() const override { return 0; }  // nothing in host memory
  const void* owner;
  int64_t pos;
};

class CudaBackendState final : public State {
 public:
  CudaBackendState(const CudaBackend& b, const KvConfig& kv, bool drafting = false)
      : b_(b), kv_(kv), drafting_(drafting) {
    CallGuard g(b_.call_lock());
    st = b_.device().new_state(kv, drafting);
  }
  ~CudaBackendState() override {
    CallGuard g(b_.call_lock());  // freeing device memory is a device call too
    b_.device().release_state(std::move(st));  // kept for the next state, or freed
  }
  int64_t position() const override { return st->position(); }
  // The device state is not readable from the host: what the KV config and
  // the model config say it holds (kv-calc's count), not what was allocated.
  StateBytes bytes() const override {
    const ModelConfig& c = b_.config();
    return {kv_cache_bytes(c, kv_, position()), kv_memory(c, kv_).constant_bytes()};
  }
  // In VRAM while the budget and the free memory allow (the copies queued,
  // nothing waited for), else in host memory.
  std::unique_ptr<StateSnapshot> snapshot() const override {
    CallGuard g(b_.call_lock());
    const CudaModel& m = b_.device();
    CudaBackend::SnapshotVram& v = b_.snapshot_vram();
    v.size_once(m);
    const size_t need = m.state_image_bytes(*st);
    if (need <= v.budget) {
      v.make_room(m, need);
      int64_t free = 0, total = 0;
      m.vram(&free, &total);
      if (free - int64_t(need) >= CudaBackend::SnapshotVram::kReserve)
        if (auto d = m.save_state_device(*st)) return std::make_unique<CudaSnapshot>(b_, std::move(d));
    }
    return std::make_unique<CudaSnapshot>(m.save_state(*st));
  }
  std::unique_ptr<StateSnapshot> rollback_point() override {
    if (kv_.scored_eviction()) return snapshot();  // h2o/tova slots move: no device restore point
    CallGuard g(b_.call_lock());
    b_.device().mark_rollback(*st);
    return std::make_unique<CudaRollbackPoint>(this, st->position());
  }
  void restore(const StateSnapshot& snap) override {
    if (const auto* r = dynamic_cast<const CudaRollbackPoint*>(&snap)) {
      CallGuard g(b_.call_lock());
      if (r->owner != this || b_.device().rollback_position(*st) != r->pos)
        fail("state restore point: not this state's latest");
      b_.device().rollback(*st);
      return;
    }
    const auto* cs = dynamic_cast<const CudaSnapshot*>(&snap);
    if (!cs) fail("state snapshot: taken on another device");
    if (cs->kv.describe() != kv_.describe()) fail("state snapshot: taken with another KV configuration");
    if (cs->drafting != drafting_)
      fail(std::string("state snapshot: taken ") + (cs->drafting ? "with" : "without") + " --mtp, restored " +
           (drafting_ ? "with" : "without"));
    // One this backend took into VRAM is guarded by its call lock (another
    // backend's lock would not keep it from moving meanwhile).
    if (cs->owner_ && cs->owner_ != &b_) fail("state snapshot: taken by another backend");
    CallGuard g(b_.call_lock());
    // Where it lives changes only under the call lock, so the cast is safe:
    // the restore reads it and, in VRAM, marks it the most recently used.
    auto& s = const_cast<CudaSnapshot&>(*cs);
    st.reset();  // before the new one: the device need not hold both
    if (s.device_) {
      b_.snapshot_vram().touch(s);
      st = b_.device().load_state(*s.device_);
    } else {
      st = b_.device().load_state(s.host);
    }
  }
  bool keeps_rows(int64_t n) override {
    CallGuard g(b_.call_lock());
    return b_.device().keeps_rows(*st, n);
  }
  bool take_back(int64_t position) override {
    CallGuard g(b_.call_lock());
    return b_.device().take_back(*st, position);
  }
  std::vector<int64_t> kv_positions(int layer) const override {
    CallGuard g(b_.call_lock());
    return b_.device().kv_positions(*st, layer);
  }
  std::vector<int64_t> kv_selected(int layer, int kv_head) const override {
    CallGuard g(b_.call_lock());
    return b_.device().kv_selected(*st, layer, kv_head);
  }
  std::unique_ptr<CudaState> st;

 private:
  const CudaBackend& b_;
  KvConfig kv_;
  bool drafting_;
};

CudaBackendState& device_state(State& st) {
  auto* s = dynamic_cast<CudaBackendState*>(&st);
  if (!s) fail("CUDA backend: the state belongs to another device");
  return *s;
}

}  // namespace

CudaBackend::CudaBackend(std::shared_ptr<const QwenModel> host, std::shared_ptr<CudaModel> device)
    : host_(std::move(host)), device_(std::move(device)), snap_vram_(std::make_unique<SnapshotVram>()) {}
CudaBackend::~CudaBackend() = default;

void CudaBackend::set_snapshot_vram_budget(size_t bytes) {
  CallGuard g(lock_);
  snap_vram_->sized = true;
  snap_vram_->budget = bytes;
  snap_vram_->make_room(*device_, 0);
}
size_t CudaBackend::snapshot_vram_budget() const {
  CallGuard g(lock_);
  snap_vram_->size_once(*device_);
  return snap_vram_->budget;
}
size_t CudaBackend::snapshot_vram_bytes() const {
  CallGuard g(lock_);
  return snap_vram_->held;
}

const ModelConfig& CudaBackend::config() const { return device_->config(); }
std::string CudaBackend::device_name() const { return device_->device_name(); }

const QwenModel& CudaBackend::model() const {
  if (!host_) fail("this model was built on the GPU (synthetic): it has no host weights");
  return *host_;
}

std::unique_ptr<State> CudaBackend::new_state(const KvConfig& kv) const {
  return std::make_unique<CudaBackendState>(*this, kv);
}

std::unique_ptr<State> CudaBackend::new_drafting_state(const KvConfig& kv) const {
  return std::make_unique<CudaBackendState>(*this, kv, /*drafting=*/true);
}

void CudaBackend::draft(State& st, int32_t next, int64_t n, const DraftPicker& pick, int32_t* drafted,
                        ThreadPool&) const {
  CudaBackendState& s = device_state(st);
  CallGuard g(lock_);
  device_->draft(*s.st, next, n, pick, drafted);
}

void CudaBackend::forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                          ThreadPool&) const {
  CudaBackendState& s = device_state(st);
  CallGuard g(lock_);
  device_->forward(*s.st, ids, n, mode, logits);
}

void CudaBackend::forward_batch(const BatchItem* items, int64_t count, ThreadPool&) const {
  std::vector<CudaBatchItem> v(size_t(std::max<int64_t>(count, 0)));
  for (int64_t i = 0; i < count; ++i) {
    const BatchItem& b = items[i];
    if (!b.state) fail("forward_batch: item " + std::to_string(i) + " has no state");
    if (b.argmax && b.mode != LogitsMode::Last)
      fail("forward_batch: item " + std::to_string(i) + " asks for an argmax without LogitsMode::Last");
    v[size_t(i)] = CudaBatchItem{device_state(*b.state).st.get(), b.ids, b.n, b.mode, b.logits, b.argmax};
  }
  CallGuard g(lock_);
  device_->forward_batch(v.data(), count);
}

void CudaBackend::greedy(State& st, int32_t first, int64_t n, int32_t* out, ThreadPool&) const {
  CudaBackendState& s = device_state(st);
  CallGuard g(lock_);
  device_->decode_greedy(*s.st, first, n, out);
}

void CudaBackend::forward_argmax_rows(State& st, const int32_t* ids, int64_t n, int32_t* best, ThreadPool&) const {
  CudaBackendState& s = device_state(st);
  CallGuard g(lock_);
  device_->forward_argmax_rows(*s.st, ids, n, best);
}

int64_t CudaBackend::weight_bytes_total() const { return device_->weight_bytes_total(); }
int64_t CudaBackend::weight_bytes_per_token() const { return device_->weight_bytes_per_token(); }

ExpertTierStats CudaBackend::tier_stats() const {
  CallGuard g(lock_);
  const CudaTierStats t = device_->tier_stats();
  ExpertTierStats s;
  s.enabled = t.enabled;
  s.vram_hits = t.vram_hits, s.host_hits = t.host_hits, s.disk_hits = t.disk_hits;
  s.promotions = t.promotions, s.promoted_bytes = t.promoted_bytes;
  s.layers = t.layers, s.experts_per_layer = t.experts_per_layer, s.slots_per_layer = t.slots_per_layer;
  s.host_slots_per_layer = t.host_slots_per_layer;
  s.expert_bytes = t.expert_bytes;
  s.disk = t.disk;
  s.host_pin_seconds = t.host_pin_seconds;
  s.prefetched = t.prefetched, s.prefetch_used = t.prefetch_used;
  s.copied_after = t.copied_after;
  return s;
}

std::string CudaBackend::expert_stats(int64_t tokens) const { return format_tier_stats(tier_stats(), tokens); }

void CudaBackend::reset_expert_stats() const {
  CallGuard g(lock_);
  device_->reset_tier_stats();
}

CudaModel& CudaBackend::device_for_bench() const { return *device_; }
CudaState& CudaBackend::device_state_for_bench(State& st) { return *device_state(st).st; }

std::string format_tier_stats(const ExpertTierStats& s, int64_t tokens) {
  if (!s.enabled) return "gpu expert cache: off (every expert in VRAM)";
  const double all = double(std::max<uint64_t>(1, s.vram_hits + s.host_hits + s.disk_hits));
  const bool disk = s.disk;
  char buf[768], where[200];
  if (disk)
    std::snprintf(where, sizeof where, "%d per layer in pinned host memory (%.2f GB), the rest read from disk",
                  s.host_slots_per_layer, double(s.host_slots_per_layer) * s.layers * s.expert_bytes / 1e9);
  else
    std::snprintf(where, sizeof where, "the other %d in pinned host memory (%.2f GB, pinned in %.1f s)",
                  s.host_slots_per_layer, double(s.host_slots_per_layer) * s.layers * s.expert_bytes / 1e9,
                  s.host_pin_seconds);
  std::snprintf(buf, sizeof buf,
                "gpu expert cache: %d of %d experts per layer in VRAM (%.2f GB), %s\n  choices served: vram %llu "
                "(%.1f%%), host %llu (%.1f%%), disk %llu (%.1f%%%s); promotions %llu (%.1f MB)",
                s.slots_per_layer, s.experts_per_layer, double(s.slots_per_layer) * s.layers * s.expert_bytes / 1e9,
                where, (unsigned long long)s.vram_hits, 100.0 * s.vram_hits / all, (unsigned long long)s.host_hits,
                100.0 * s.host_hits / all, (unsigned long long)s.disk_hits, 100.0 * s.disk_hits / all,
                disk ? "" : ", each expert in one tier", (unsigned long long)s.promotions,
                double(s.promoted_bytes) / 1e6);
  std::string out = buf;
  if (s.prefetched > 0) {
    std::snprintf(buf, sizeof buf, "; copied ahead %llu, read from the copy %llu (%.1f%%)",
                  (unsigned long long)s.prefetched, (unsigned long long)s.prefetch_used,
                  100.0 * double(s.prefetch_used) / double(s.prefetched));
    out += buf;
  }
  if (s.copied_after > 0) {
    std::snprintf(buf, sizeof buf, "; copied after the router %llu", (unsigned long long)s.copied_after);
    out += buf;
  }
  if (tokens > 0) {
    std::snprintf(buf, sizeof buf, "; %.1f MB per token over the host link",
                  double(s.host_hits + s.disk_hits) * double(s.expert_bytes) / double(tokens) / 1e6);
    out += buf;
  }
  return out;
}

Obstacle cuda_presence() {
  std::string why;
  bool too_old = false;
  if (CudaModel::available(&why, &too_old)) return {};
  return {too_old ? ObstacleCode::OldDevice : ObstacleCode::NoDevice, why};
}

Obstacle cuda_weight_obstacle(const QwenModel& m) {
  // Routed experts in any format (checkpoint, packed bf16/q8/q4/fp8, GGUF
  // blocks, mmapped or streamed) are read through the expert store at
  // upload; FP8 routed experts stay FP8 (fp8_experts.cuh), GGUF blocks as
  // stored (gguf_blocks.cuh). The other weights must be floats, GGUF or FP8
  // blocks (kept as stored) or q8/q4 (an MLX checkpoint's, dequantised to f32
  // at upload).
  std::optional<DType> other;
  auto check = [&](const Matrix& x) {
    if (x.empty() || x.quantized()) return;
    if (x.dtype != DType::F32 && x.dtype != DType::F16 && x.dtype != DType::BF16) other = x.dtype;
  };
  auto check_ffn = [&](const FfnExpert& e) {
    check(e.gate);
    check(e.up);
    check(e.down);
  };
  const ModelWeights& w = m.weights();
  check(w.embed);
  check(w.lm_head);
  for (const LayerWeights& l : w.layers) {
    for (const Matrix* x : {&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj, &l.attn.o_proj, &l.lin.out_proj,
                            &l.ffn.router, &l.ffn.shared_gate})
      check(*x);
    for (const Matrix& x : l.lin.in_proj.stored) check(x);
    check_ffn(l.ffn.shared);
    check_ffn(l.ffn.dense);
    for (const FfnExpert& e : l.ffn.experts) check_ffn(e);
  }
  if (other)
    return {ObstacleCode::WeightType, std::string("weights stored as ") + dtype_name(*other) +
                                          " (the CUDA backend reads bf16, f16 and f32)"};
  return {};
}

CudaOptions cuda_options(const GpuOptions& o, const ModelFootprint* f) {
  CudaOptions c;
  c.expert_cache_gb = o.expert_cache_gb;
  c.expert_cache_fraction = o.expert_cache_fraction;
  c.host_cache_gb = o.host_cache_gb;
  c.host_cache_fraction = o.host_cache_fraction;
  c.decode.prefill_profile = o.prefill_profile;
  c.decode.gguf_expert_chunks = o.gguf_expert_chunks;
  MachineMemory mm;
  if (f && CudaModel::memory_info(&mm.vram_free, &mm.vram_total)) {  // without a GPU the upload says so
    probe_host_memory(&mm);
    const MemoryPlan p = plan_memory(mm, *f, o);
    if (o.show_plan) {
      std::fprintf(stderr, "%s\n", p.describe().c_str());
      std::fflush(stderr);
    }
    c.plan_vram_slots = p.vram_slots;
    c.plan_host_slots = p.tiered ? p.host_slots : -1;
  }
  return c;
}

std::unique_ptr<Backend> make_cuda_backend(std::shared_ptr<const QwenModel> model, const GpuOptions& o) {
  const ModelFootprint f = model_footprint(*model, o.plan_context);
  std::unique_ptr<CudaModel> device = CudaModel::upload(*model, cuda_options(o, &f));
  return std::make_unique<CudaBackend>(std::move(model), std::move(device));
}

}  // namespace flashmoe
