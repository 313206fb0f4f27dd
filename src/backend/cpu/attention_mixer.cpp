// Gated full attention (Qwen3.5 / Qwen3-Next): per-head q/k RMSNorm, partial
// NeoX rotary, GQA softmax attention over the KV cache, output gated by
// sigmoid of the second half of each head's q_proj rows.
#include <cmath>
#include <vector>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"

namespace flashmoe::cpu {

void gated_attention_mixer(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq,
                           KvCache& cache, int64_t pos0, const float* x, int64_t n, float* out, ThreadPool& pool) {
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim, rd = c.rotary_dim;
  const int64_t qg_row = 2 * nh * hd, kv_row = nkv * hd;
  std::vector<float> qg(size_t(n * qg_row)), k(size_t(n * kv_row)), v(size_t(n * kv_row));
  std::vector<float> attn(size_t(n * nh * hd)), q(size_t(n * nh * hd));
  matmul(pool, w.q_proj, x, n, qg.data());
  matmul(pool, w.k_proj, x, n, k.data());
  matmul(pool, w.v_proj, x, n, v.data());
  const float scale = 1.0f / std::sqrt(float(hd));

  // Per token and independent of the others: q/k norms and rotary.
  pool.parallel_for(n, [&](int64_t t0, int64_t t1) {
    std::vector<float> cs(size_t(rd / 2)), sn(size_t(rd / 2));
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < rd / 2; ++i) {
        float f = float(pos0 + t) * rope_inv_freq[i];  // fp32 angle, as the reference computes it
        cs[i] = float(std::cos(double(f)));
        sn[i] = float(std::sin(double(f)));
      }
      const float* qgt = qg.data() + t * qg_row;
      for (int64_t h = 0; h < nh; ++h) {
        float* qh = q.data() + (t * nh + h) * hd;
        rmsnorm_zc(qgt + h * 2 * hd, w.q_norm.data(), hd, c.rms_norm_eps, qh);
        rope_neox(qh, rd, cs.data(), sn.data());
      }
      float* kt = k.data() + t * kv_row;
      for (int64_t h = 0; h < nkv; ++h) {
        rmsnorm_zc(kt + h * hd, w.k_norm.data(), hd, c.rms_norm_eps, kt + h * hd);
        rope_neox(kt + h * hd, rd, cs.data(), sn.data());
      }
    }
  }, 8);
  auto gate = [&](int64_t t) {
    const float* qgt = qg.data() + t * qg_row;
    float* at = attn.data() + t * nh * hd;
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t d = 0; d < hd; ++d) at[h * hd + d] *= sigmoid(qgt[h * 2 * hd + hd + d]);
  };

  if (cache.supports_prefix_attention()) {
    // Full retention: the whole chunk's keys and values go in first, then
    // every token attends over its causal prefix of the cache at once, on all
    // threads: the same sums as token by token. Longest prefixes first, so
    // the threads that claim the last (shortest) ones finish together.
    for (int64_t t = 0; t < n; ++t) cache.append(pos0 + t, k.data() + t * kv_row, v.data() + t * kv_row);
    const int64_t before = cache.size() - n;
    pool.parallel_for(n, [&](int64_t i0, int64_t i1) {
      thread_local KvCache::AttendScratch scratch;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = n - 1 - i;
        cache.attend_prefix(q.data() + t * nh * hd, nh, scale, attn.data() + t * nh * hd, before + t + 1, scratch);
        gate(t);
      }
    });
  } else {
    // Windows and eviction policies: token by token through the cache, the
    // reference semantics (an append can overwrite or evict what an earlier
    // token of the chunk attended to).
    for (int64_t t = 0; t < n; ++t) {
      cache.append(pos0 + t, k.data() + t * kv_row, v.data() + t * kv_row);
      cache.attend(q.data() + t * nh * hd, nh, scale, attn.data() + t * nh * hd);
      gate(t);
    }
  }
  matmul(pool, w.o_proj, attn.data(), n, out);
}

}  // namespace flashmoe::cpu
