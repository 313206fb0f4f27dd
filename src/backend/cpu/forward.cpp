// The layer walk: embeddings, then per LayerPlan a pre-norm mixer and a
// pre-norm feed-forward, each added to the residual stream, then the final
// norm and the LM head for the rows whose logits are wanted. One walk serves
// one sequence and a batch: a step stacks the rows of every sequence in it.
#include "backend/cpu/forward.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/mtp.h"
#include "backend/cpu/ops.h"
#include "core/aligned.h"
#include "core/error.h"
#include "model/plan.h"

namespace flashmoe::cpu {

namespace {

// Prompts are processed in chunks of this many tokens per sequence: enough
// to amortise weight reads across tokens, small enough to bound activation
// memory.
constexpr int64_t kPrefillChunk = 256;

// x[t] += add[t] (when add is given), then xn[t] = RMSNorm(x[t]) (when w is
// given), for the n rows, spread over the threads. A row's bits do not
// depend on the split: the same element-wise adds and the same norm.
void add_and_norm(ThreadPool& pool, float* x, const float* add, const float* w, int64_t n, int64_t H, float eps,
                  float* xn) {
  pool.parallel_for(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xt = x + t * H;
      if (add)
        for (int64_t i = 0; i < H; ++i) xt[i] += add[t * H + i];
      if (w) rmsnorm_zc(xt, w, H, eps, xn + t * H);
    }
  }, kRowGrain);
}

// One sequence's tokens in a step and where its logits go: `logit_rows`
// rows (0, 1, or n) wanted from its last rows, written to `logits`.
struct StepPart {
  SequenceRows rows;
  const int32_t* ids;
  int64_t logit_rows;
  float* logits;
};

void forward_step(const QwenModel& m, const std::vector<StepPart>& parts, ThreadPool& pool,
                  std::vector<std::vector<float>>* hidden) {
  const ModelConfig& c = m.config();
  const ModelWeights& w = m.weights();
  const ModelPlan& plan = m.plan();
  ExpertStore& store = m.expert_store();
  const int64_t H = c.hidden_size;
  std::vector<SequenceRows> seqs;
  int64_t n = 0;
  for (const StepPart& p : parts) {
    seqs.push_back(p.rows);
    n += p.rows.n;
  }
  // The residual stream and the layers' inputs and updates, kept on this
  // thread across steps (every element is written before it is read):
  // clearing fresh ones was serial time between the parallel loops. The
  // names are references so that the loops' workers use this thread's.
  thread_local AlignedFloats kept[3];
  AlignedFloats &x = kept[0], &xn = kept[1], &out = kept[2];
  x.resize(size_t(n * H));
  xn.resize(size_t(n * H));
  out.resize(size_t(n * H));
  // Every sequence's embedding rows in one parallel loop (a loop per
  // sequence was a barrier per decoding sequence of the step).
  std::vector<const int32_t*> row_ids(static_cast<size_t>(n));
  for (const StepPart& p : parts)
    for (int64_t t = 0; t < p.rows.n; ++t) row_ids[size_t(p.rows.row0 + t)] = p.ids + t;
  pool.parallel_for(n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) load_row(w.embed, *row_ids[size_t(r)], x.data() + r * H);
  }, kRowGrain);
  auto capture = [&](int64_t layer) {
    if (hidden) (*hidden)[size_t(layer)].insert((*hidden)[size_t(layer)].end(), x.begin(), x.end());
  };
  capture(0);

  for (const LayerPlan& l : plan.layers) {
    const LayerWeights& lw = w.layers[size_t(l.index)];
    add_and_norm(pool, x.data(), nullptr, lw.input_norm.data(), n, H, c.rms_norm_eps, xn.data());
    switch (l.mixer) {
      case MixerKind::GatedAttention:
        gated_attention_mixer(c, lw.attn, plan.rope_inv_freq.data(), l.state_slot, seqs, xn.data(), n, out.data(),
                              pool);
        break;
      case MixerKind::GatedDeltaNet:
        gated_delta_net_mixer(c, lw.lin, l.state_slot, seqs, xn.data(), n, out.data(), pool);
        break;
    }
    add_and_norm(pool, x.data(), out.data(), lw.post_norm.data(), n, H, c.rms_norm_eps, xn.data());
    switch (l.ffn) {
      case FfnKind::DenseSwiGLU:
        dense_swiglu_ffn(lw.ffn.dense, xn.data(), n, out.data(), pool);
        break;
      case FfnKind::RoutedMoE:
        routed_moe_ffn(c, lw.ffn, l.shared_expert, store, l.index, xn.data(), n, out.data(), pool);
        break;
    }
    add_and_norm(pool, x.data(), out.data(), nullptr, n, H, c.rms_norm_eps, nullptr);
    capture(l.index + 1);
  }
  for (const StepPart& p : parts) {
    ModelState& st = *p.rows.state;
    const int64_t pos0 = st.pos;
    st.pos += p.rows.n;
    if (st.drafting) {
      // The MTP head reads every token's final-normed hidden state.
      std::vector<float> hn(size_t(p.rows.n * H));
      for (int64_t t = 0; t < p.rows.n; ++t)
        rmsnorm_zc(x.data() + (p.rows.row0 + t) * H, w.final_norm.data(), H, c.rms_norm_eps, hn.data() + t * H);
      advance_mtp(m, st, pos0, p.ids, p.rows.n, hn.data(), pool);
    }
  }
  store.note_tokens(n);

  // The LM head once over every wanted row; a single sequence's rows go
  // straight to its logits, several are gathered and copied back out.
  int64_t rows = 0, wanting = 0;
  for (const StepPart& p : parts) {
    rows += p.logit_rows;
    wanting += p.logit_rows > 0 ? 1 : 0;
  }
  if (rows == 0) return;
  std::vector<float> xl(size_t(rows * H));
  int64_t r = 0;
  for (const StepPart& p : parts)
    for (int64_t t = p.rows.row0 + p.rows.n - p.logit_rows; t < p.rows.row0 + p.rows.n; ++t, ++r)
      rmsnorm_zc(x.data() + t * H, w.final_norm.data(), H, c.rms_norm_eps, xl.data() + r * H);
  const int64_t V = c.vocab_size;
  if (wanting == 1) {
    for (const StepPart& p : parts)
      if (p.logit_rows > 0) matmul(pool, w.lm_head, xl.data(), rows, p.logits);
    return;
  }
  std::vector<float> logits(size_t(rows * V));
  matmul(pool, w.lm_head, xl.data(), rows, logits.data());
  r = 0;
  for (const StepPart& p : parts) {
    if (p.logit_rows == 0) continue;
    std::memcpy(p.logits, logits.data() + r * V, size_t(p.logit_rows * V) * sizeof(float));
    r += p.logit_rows;
  }
}

void forward_batch_impl(const QwenModel& m, const SequenceInput* items, int64_t count, ThreadPool& pool,
                        std::vector<std::vector<float>>* hidden) {
  const ModelConfig& c = m.config();
  for (int64_t i = 0; i < count; ++i) {
    if (!items[i].state) fail("forward_batch: item " + std::to_string(i) + " has no state");
    if (items[i].n < 0) fail("forward_batch: item " + std::to_string(i) + " has a negative token count");
    for (int64_t j = 0; j < i; ++j)
      if (items[j].state == items[i].state) fail("forward_batch: one state appears twice in a batch");
    check_token_ids(c, items[i].ids, items[i].n);
  }
  if (hidden) hidden->assign(size_t(c.num_layers + 1), {});
  // Step s takes tokens [s * chunk, (s + 1) * chunk) of every item that has them.
  int64_t longest = 0;
  for (int64_t i = 0; i < count; ++i) longest = std::max(longest, items[i].n);
  for (int64_t b = 0; b < longest; b += kPrefillChunk) {
    std::vector<StepPart> parts;
    int64_t row = 0;
    for (int64_t i = 0; i < count; ++i) {
      const SequenceInput& it = items[i];
      if (b >= it.n) continue;
      const int64_t len = std::min(kPrefillChunk, it.n - b);
      const bool last_chunk = b + len == it.n;
      StepPart p{{it.state, row, len}, it.ids + b, 0, it.logits};
      if (it.mode == LogitsMode::All) {
        p.logit_rows = len;
        p.logits = it.logits + b * c.vocab_size;
      } else if (it.mode == LogitsMode::Last && last_chunk) {
        p.logit_rows = 1;
      }
      parts.push_back(p);
      row += len;
    }
    forward_step(m, parts, pool, hidden);
  }
}

}  // namespace

void forward_batch(const QwenModel& m, const SequenceInput* items, int64_t count, ThreadPool& pool) {
  forward_batch_impl(m, items, count, pool, nullptr);
}

void forward(const QwenModel& m, ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
             ThreadPool& pool, std::vector<std::vector<float>>* hidden) {
  const SequenceInput item{&st, ids, n, mode, logits};
  forward_batch_impl(m, &item, 1, pool, hidden);
}

}  // namespace flashmoe::cpu
