// The MTP head: fc over [norm_e(embed(token)) | norm_h(hidden)], one
// pre-norm decoder layer (gated attention over the head's own KV cache, then
// its FFN), then the head's final norm; the logits from the shared lm_head.
#include "backend/cpu/mtp.h"

#include <vector>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "core/error.h"

namespace flashmoe::cpu {

namespace {

// The head over `rows` entries (token ids[r] with hidden[r, H]) at positions
// pos0.., appending to `cache`. With out: the head's normed output [rows, H];
// without, only the attention runs (enough to fill the cache).
void run_head(const QwenModel& m, KvCache& cache, int64_t pos0, const int32_t* ids, const float* hidden,
              int64_t rows, float* out, ThreadPool& pool) {
  const ModelConfig& c = m.config();
  const MtpWeights& w = *m.weights().mtp;
  const LayerPlan& l = *m.plan().mtp;
  const int64_t H = c.hidden_size;
  const float eps = c.rms_norm_eps;
  std::vector<float> in(size_t(rows * 2 * H)), e(static_cast<size_t>(H)), x(size_t(rows * H)), xn(size_t(rows * H)),
      upd(size_t(rows * H));
  for (int64_t r = 0; r < rows; ++r) {
    load_row(m.weights().embed, ids[r], e.data());
    rmsnorm_zc(e.data(), w.norm_embedding.data(), H, eps, in.data() + r * 2 * H);
    rmsnorm_zc(hidden + r * H, w.norm_hidden.data(), H, eps, in.data() + r * 2 * H + H);
  }
  matmul(pool, w.fc, in.data(), rows, x.data());
  const LayerWeights& lw = w.layer;
  for (int64_t r = 0; r < rows; ++r) rmsnorm_zc(x.data() + r * H, lw.input_norm.data(), H, eps, xn.data() + r * H);
  gated_attention_mixer(c, lw.attn, m.plan().rope_inv_freq.data(), cache, pos0, xn.data(), rows, upd.data(), pool);
  if (!out) return;
  for (size_t i = 0; i < x.size(); ++i) x[i] += upd[i];
  for (int64_t r = 0; r < rows; ++r) rmsnorm_zc(x.data() + r * H, lw.post_norm.data(), H, eps, xn.data() + r * H);
  switch (l.ffn) {
    case FfnKind::DenseSwiGLU:
      dense_swiglu_ffn(lw.ffn.dense, xn.data(), rows, upd.data(), pool);
      break;
    case FfnKind::RoutedMoE:
      routed_moe_ffn(c, lw.ffn, l.shared_expert, *m.mtp_expert_store(), l.moe_slot, xn.data(), rows, upd.data(),
                     pool);
      break;
  }
  for (size_t i = 0; i < x.size(); ++i) x[i] += upd[i];
  for (int64_t r = 0; r < rows; ++r) rmsnorm_zc(x.data() + r * H, w.final_norm.data(), H, eps, out + r * H);
}

}  // namespace

void advance_mtp(const QwenModel& m, ModelState& st, int64_t pos0, const int32_t* ids, int64_t n,
                 const float* hidden, ThreadPool& pool) {
  const int64_t H = m.config().hidden_size;
  const int64_t t0 = st.mtp_hidden.empty() ? 1 : 0;  // the first token of all completes no entry
  if (n > t0) {
    std::vector<float> h(size_t((n - t0) * H));
    for (int64_t t = t0; t < n; ++t) {
      const float* src = t == 0 ? st.mtp_hidden.data() : hidden + (t - 1) * H;
      std::copy(src, src + H, h.data() + (t - t0) * H);
    }
    run_head(m, st.mtp_kv.at(0), pos0 + t0 - 1, ids + t0, h.data(), n - t0, nullptr, pool);
  }
  st.mtp_hidden.assign(hidden + (n - 1) * H, hidden + n * H);
}

void mtp_draft(const QwenModel& m, const ModelState& st, int32_t next, int64_t n, const DraftPicker& pick,
               int32_t* drafted, ThreadPool& pool) {
  if (!st.drafting) fail("draft: the state was not made for drafting (--mtp)");
  if (st.mtp_hidden.empty()) fail("draft: feed a prompt first");
  check_token_ids(m.config(), &next, 1);
  const int64_t H = m.config().hidden_size, V = m.config().vocab_size;
  KvCache cache = st.mtp_kv.at(0);
  std::vector<float> h = st.mtp_hidden, out(static_cast<size_t>(H)), logits(static_cast<size_t>(V));
  int32_t tok = next;
  for (int64_t k = 0; k < n; ++k) {
    run_head(m, cache, st.pos - 1 + k, &tok, h.data(), 1, out.data(), pool);
    matmul(pool, m.weights().lm_head, out.data(), 1, logits.data());
    tok = drafted[k] = pick(logits.data(), k);
    check_token_ids(m.config(), &tok, 1);
    h.swap(out);
  }
}

}  // namespace flashmoe::cpu
