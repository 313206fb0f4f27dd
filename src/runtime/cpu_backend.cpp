#include "runtime/cpu_backend.h"

#include <algorithm>

#include "backend/cpu/forward.h"
#include "backend/cpu/mtp.h"
#include "core/argmax.h"
#include "core/error.h"
#include "model/weight_bytes.h"

namespace flashmoe {

namespace {

class CpuSnapshot final : public StateSnapshot {
 public:
  CpuSnapshot(const ModelState& s, const KvConfig& kv) : state(s), kv(kv) {}
  int64_t position() const override { return state.pos; }
  size_t bytes() const override { return state.kv_bytes() + state.recurrent_bytes(); }
  ModelState state;
  KvConfig kv;
};

// A restore point that copies only what feeding more tokens overwrites: the
// recurrent states and the head's hidden state, and each KV cache's length
// (the caches are truncated back: CpuState::rollback_point makes one only
// where every cache is truncatable). For its own state only.
class CpuRestorePoint final : public StateSnapshot {
 public:
  int64_t position() const override { return pos; }
  size_t bytes() const override {
    size_t n = mtp_hidden.size() * sizeof(float);
    for (const auto& c : conv) n += c.size() * sizeof(float);
    for (const auto& c : ssm) n += c.size() * sizeof(float);
    return n;
  }
  const void* owner = nullptr;
  int64_t pos = 0;
  std::vector<std::vector<float>> conv, ssm;
  std::vector<float> mtp_hidden;
  std::vector<int64_t> kv_n, mtp_kv_n;
};

class CpuState final : public State {
 public:
  CpuState(ModelState s, const KvConfig& kv) : state(std::move(s)), kv_(kv) {}
  int64_t position() const override { return state.pos; }
  StateBytes bytes() const override { return {int64_t(state.kv_bytes()), int64_t(state.recurrent_bytes())}; }
  std::unique_ptr<StateSnapshot> snapshot() const override { return std::make_unique<CpuSnapshot>(state, kv_); }
  std::unique_ptr<StateSnapshot> rollback_point() override {
    auto ok = [](const std::vector<KvCache>& v) {
      return std::all_of(v.begin(), v.end(), [](const KvCache& c) { return c.truncatable(); });
    };
    if (!ok(state.kv) || !ok(state.mtp_kv)) return snapshot();
    auto p = std::make_unique<CpuRestorePoint>();
    p->owner = this;
    p->pos = state.pos;
    p->conv = state.conv;
    p->ssm = state.ssm;
    p->mtp_hidden = state.mtp_hidden;
    for (const KvCache& c : state.kv) p->kv_n.push_back(c.size());
    for (const KvCache& c : state.mtp_kv) p->mtp_kv_n.push_back(c.size());
    return p;
  }
  void restore(const StateSnapshot& snap) override {
    if (const auto* p = dynamic_cast<const CpuRestorePoint*>(&snap)) {
      if (p->owner != this || p->pos > state.pos) fail("state restore point: not from this state's past");
      for (size_t i = 0; i < state.kv.size(); ++i) state.kv[i].truncate(p->kv_n[i]);
      for (size_t i = 0; i < state.mtp_kv.size(); ++i) state.mtp_kv[i].truncate(p->mtp_kv_n[i]);
      // Element-wise copies into the existing buffers: no allocation.
      for (size_t i = 0; i < state.conv.size(); ++i) std::copy(p->conv[i].begin(), p->conv[i].end(), state.conv[i].begin());
      for (size_t i = 0; i < state.ssm.size(); ++i) std::copy(p->ssm[i].begin(), p->ssm[i].end(), state.ssm[i].begin());
      state.mtp_hidden = p->mtp_hidden;
      state.pos = p->pos;
      return;
    }
    const auto* s = dynamic_cast<const CpuSnapshot*>(&snap);
    if (!s) fail("state snapshot: taken on another device");
    if (s->kv.describe() != kv_.describe()) fail("state snapshot: taken with another KV configuration");
    if (s->state.drafting != state.drafting)
      fail(std::string("state snapshot: taken ") + (s->state.drafting ? "with" : "without") + " --mtp, restored " +
           (state.drafting ? "with" : "without"));
    state = s->state;
  }
  std::vector<int64_t> kv_positions(int layer) const override {
    if (layer < 0 || size_t(layer) >= state.kv.size()) fail("kv_positions: no attention layer " + std::to_string(layer));
    return state.kv[size_t(layer)].positions();
  }
  std::vector<int64_t> kv_selected(int layer, int kv_head) const override {
    if (layer < 0 || size_t(layer) >= state.kv.size()) fail("kv_selected: no attention layer " + std::to_string(layer));
    return state.kv[size_t(layer)].quest_selected(kv_head);
  }
  ModelState state;

 private:
  KvConfig kv_;
};

CpuState& cpu_state(State& st) {
  auto* s = dynamic_cast<CpuState*>(&st);
  if (!s) fail("CPU backend: the state belongs to another device");
  return *s;
}

}  // namespace

CpuBackend::CpuBackend(std::shared_ptr<const QwenModel> model) : model_(std::move(model)) {}

const ModelConfig& CpuBackend::config() const { return model_->config(); }

std::unique_ptr<State> CpuBackend::new_state(const KvConfig& kv) const {
  return std::make_unique<CpuState>(model_->new_state(kv), kv);
}

std::unique_ptr<State> CpuBackend::new_drafting_state(const KvConfig& kv) const {
  return std::make_unique<CpuState>(model_->new_state(kv, /*drafting=*/true), kv);
}

void CpuBackend::draft(State& st, int32_t next, int64_t n, const DraftPicker& pick, int32_t* drafted,
                       ThreadPool& pool) const {
  const int64_t V = config().vocab_size;
  const DraftPicker best = [V](const float* logits, int64_t) { return int32_t(argmax(logits, V)); };
  cpu::mtp_draft(*model_, cpu_state(st).state, next, n, pick ? pick : best, drafted, pool);
}

void CpuBackend::forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                         ThreadPool& pool) const {
  forward_capturing(st, ids, n, mode, logits, pool, nullptr);
}

void CpuBackend::forward_batch(const BatchItem* items, int64_t count, ThreadPool& pool) const {
  std::vector<cpu::SequenceInput> inputs(static_cast<size_t>(std::max<int64_t>(count, 0)));
  const BatchArgmax am(items, count, config().vocab_size);
  for (int64_t i = 0; i < count; ++i) {
    const BatchItem& it = am.items()[i];
    if (!it.state) fail("forward_batch: item " + std::to_string(i) + " has no state");
    inputs[size_t(i)] = {&cpu_state(*it.state).state, it.ids, it.n, it.mode, it.logits};
  }
  cpu::forward_batch(*model_, inputs.data(), count, pool);
  am.finish();
}

void CpuBackend::forward_capturing(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                                   ThreadPool& pool, std::vector<std::vector<float>>* hidden) const {
  cpu::forward(*model_, cpu_state(st).state, ids, n, mode, logits, pool, hidden);
}

void CpuBackend::greedy(State& st, int32_t first, int64_t n, int32_t* out, ThreadPool& pool) const {
  const int64_t V = config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  int32_t next = first;
  for (int64_t i = 0; i < n; ++i) {
    forward(st, &next, 1, LogitsMode::Last, logits.data(), pool);
    out[i] = next = argmax(logits.data(), V);
  }
}

int64_t CpuBackend::weight_bytes_total() const { return count_weight_bytes(config(), model_->weights()).total; }
int64_t CpuBackend::weight_bytes_per_token() const {
  return count_weight_bytes(config(), model_->weights()).per_token;
}

std::string CpuBackend::expert_stats(int64_t) const {
  const ModelConfig& c = config();
  int64_t moe = 0;
  for (bool b : c.layer_is_moe) moe += b ? 1 : 0;
  return format_expert_stats(model_->expert_store().stats(), moe, c.num_experts_per_tok) + "\n  store: " +
         model_->expert_store().describe();
}

void CpuBackend::reset_expert_stats() const { model_->expert_store().reset_stats(); }

}  // namespace flashmoe
