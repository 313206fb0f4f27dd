// Gated full attention (Qwen3.5 / Qwen3-Next): per-head q/k RMSNorm, partial
// NeoX rotary, GQA softmax attention over the KV cache, output gated by
// sigmoid of the second half of each head's q_proj rows.
#include <cmath>
#include <vector>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"

namespace flashmoe::cpu {

void gated_attention_mixer(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq, int slot,
                           const std::vector<SequenceRows>& seqs, const float* x, int64_t rows, float* out,
                           ThreadPool& pool) {
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim, rd = c.rotary_dim;
  const int64_t qg_row = 2 * nh * hd, kv_row = nkv * hd;
  std::vector<float> qg(size_t(rows * qg_row)), k(size_t(rows * kv_row)), v(size_t(rows * kv_row));
  std::vector<float> attn(size_t(rows * nh * hd));
  matmul(pool, w.q_proj, x, rows, qg.data());
  matmul(pool, w.k_proj, x, rows, k.data());
  matmul(pool, w.v_proj, x, rows, v.data());
  const float scale = 1.0f / std::sqrt(float(hd));

  // Each sequence through its own cache, token by token (the reference
  // semantics for every retention policy, cheap next to the projections);
  // the sequences of a batch are independent, so they share the threads.
  pool.parallel_for(int64_t(seqs.size()), [&](int64_t s0, int64_t s1) {
    std::vector<float> q(size_t(nh * hd)), cs(size_t(rd / 2)), sn(size_t(rd / 2));
    for (int64_t s = s0; s < s1; ++s) {
      const SequenceRows& seq = seqs[size_t(s)];
      KvCache& cache = seq.state->kv[size_t(slot)];
      for (int64_t t = seq.row0; t < seq.row0 + seq.n; ++t) {
        const int64_t pos = seq.state->pos + (t - seq.row0);
        for (int64_t i = 0; i < rd / 2; ++i) {
          float f = float(pos) * rope_inv_freq[i];  // fp32 angle, as the reference computes it
          cs[i] = float(std::cos(double(f)));
          sn[i] = float(std::sin(double(f)));
        }
        const float* qgt = qg.data() + t * qg_row;
        for (int64_t h = 0; h < nh; ++h) {
          float* qh = q.data() + h * hd;
          rmsnorm_zc(qgt + h * 2 * hd, w.q_norm.data(), hd, c.rms_norm_eps, qh);
          rope_neox(qh, rd, cs.data(), sn.data());
        }
        float* kt = k.data() + t * kv_row;
        for (int64_t h = 0; h < nkv; ++h) {
          rmsnorm_zc(kt + h * hd, w.k_norm.data(), hd, c.rms_norm_eps, kt + h * hd);
          rope_neox(kt + h * hd, rd, cs.data(), sn.data());
        }
        cache.append(pos, kt, v.data() + t * kv_row);
        float* at = attn.data() + t * nh * hd;
        cache.attend(q.data(), nh, scale, at);
        for (int64_t h = 0; h < nh; ++h)
          for (int64_t d = 0; d < hd; ++d) at[h * hd + d] *= sigmoid(qgt[h * 2 * hd + hd + d]);
      }
    }
  });
  matmul(pool, w.o_proj, attn.data(), rows, out);
}

}  // namespace flashmoe::cpu
