// The layer walk: embeddings, then per LayerPlan a pre-norm mixer and a
// pre-norm feed-forward, each added to the residual stream, then the final
// norm and the LM head for the rows whose logits are wanted.
#include "backend/cpu/forward.h"

#include <algorithm>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/mtp.h"
#include "backend/cpu/ops.h"
#include "model/plan.h"

namespace flashmoe::cpu {

namespace {

// Prompts are processed in chunks of this many tokens: enough to amortise
// weight reads across tokens, small enough to bound activation memory.
constexpr int64_t kPrefillChunk = 256;

void forward_chunk(const QwenModel& m, ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode,
                   float* logits, ThreadPool& pool, std::vector<std::vector<float>>* hidden) {
  const ModelConfig& c = m.config();
  const ModelWeights& w = m.weights();
  const ModelPlan& plan = m.plan();
  ExpertStore& store = m.expert_store();
  const int64_t H = c.hidden_size;
  std::vector<float> x(size_t(n * H)), xn(size_t(n * H)), out(size_t(n * H));
  for (int64_t t = 0; t < n; ++t) load_row(w.embed, ids[t], x.data() + t * H);
  auto capture = [&](int64_t layer) {
    if (hidden) (*hidden)[size_t(layer)].insert((*hidden)[size_t(layer)].end(), x.begin(), x.end());
  };
  capture(0);

  for (const LayerPlan& l : plan.layers) {
    const LayerWeights& lw = w.layers[size_t(l.index)];
    for (int64_t t = 0; t < n; ++t)
      rmsnorm_zc(x.data() + t * H, lw.input_norm.data(), H, c.rms_norm_eps, xn.data() + t * H);
    switch (l.mixer) {
      case MixerKind::GatedAttention:
        gated_attention_mixer(c, lw.attn, plan.rope_inv_freq.data(), st.kv[size_t(l.state_slot)], st.pos,
                              xn.data(), n, out.data(), pool);
        break;
      case MixerKind::GatedDeltaNet:
        gated_delta_net_mixer(c, lw.lin, st.conv[size_t(l.state_slot)], st.ssm[size_t(l.state_slot)], xn.data(), n,
                              out.data(), pool);
        break;
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
    for (int64_t t = 0; t < n; ++t)
      rmsnorm_zc(x.data() + t * H, lw.post_norm.data(), H, c.rms_norm_eps, xn.data() + t * H);
    switch (l.ffn) {
      case FfnKind::DenseSwiGLU:
        dense_swiglu_ffn(lw.ffn.dense, xn.data(), n, out.data(), pool);
        break;
      case FfnKind::RoutedMoE:
        routed_moe_ffn(c, lw.ffn, l.shared_expert, store, l.index, xn.data(), n, out.data(), pool);
        break;
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
    capture(l.index + 1);
  }
  const int64_t pos0 = st.pos;
  st.pos += n;
  store.note_tokens(n);

  if (st.drafting) {
    // The head reads every token's final-normed hidden state.
    for (int64_t t = 0; t < n; ++t)
      rmsnorm_zc(x.data() + t * H, w.final_norm.data(), H, c.rms_norm_eps, xn.data() + t * H);
    advance_mtp(m, st, pos0, ids, n, xn.data(), pool);
    if (mode == LogitsMode::None) return;
    const int64_t first = mode == LogitsMode::All ? 0 : n - 1;
    matmul(pool, w.lm_head, xn.data() + first * H, n - first, logits);
    return;
  }
  if (mode == LogitsMode::None) return;
  const int64_t first = mode == LogitsMode::All ? 0 : n - 1;
  const int64_t rows = n - first;
  for (int64_t t = first; t < n; ++t)
    rmsnorm_zc(x.data() + t * H, w.final_norm.data(), H, c.rms_norm_eps, xn.data() + (t - first) * H);
  matmul(pool, w.lm_head, xn.data(), rows, logits);
}

}  // namespace

void forward(const QwenModel& m, ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
             ThreadPool& pool, std::vector<std::vector<float>>* hidden) {
  const ModelConfig& c = m.config();
  check_token_ids(c, ids, n);
  if (hidden) hidden->assign(size_t(c.num_layers + 1), {});
  for (int64_t b = 0; b < n; b += kPrefillChunk) {
    const int64_t len = std::min(kPrefillChunk, n - b);
    const bool last_chunk = b + len == n;
    const LogitsMode cm = mode == LogitsMode::All ? LogitsMode::All : (last_chunk ? mode : LogitsMode::None);
    float* out = mode == LogitsMode::All ? logits + b * c.vocab_size : logits;
    forward_chunk(m, st, ids + b, len, cm, out, pool, hidden);
  }
}

}  // namespace flashmoe::cpu
