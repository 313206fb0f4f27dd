// Gated full attention (Qwen3.5 / Qwen3-Next): per-head q/k RMSNorm, partial
// NeoX rotary, GQA softmax attention over the KV cache, output gated by
// sigmoid of the second half of each head's q_proj rows.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "core/aligned.h"
#include "core/simd.h"

namespace flashmoe::cpu {

namespace {

// One sequence's rows [row0, row0 + n) and the cache they attend through,
// the first at position pos0.
struct CacheRows {
  KvCache* cache;
  int64_t pos0, row0, n;
};

void attention_over(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq,
                    const std::vector<CacheRows>& seqs, const float* x, int64_t rows, float* out, ThreadPool& pool) {
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim, rd = c.rotary_dim;
  const int64_t qg_row = 2 * nh * hd, kv_row = nkv * hd;
  // Kept on this thread across calls (each element is written before it is
  // read): a prompt chunk's buffers are megabytes, and clearing fresh ones
  // (page faults included) was serial time between the parallel loops. The
  // names are references so that the loops' workers use this thread's.
  thread_local AlignedFloats kept[5];
  AlignedFloats &qg = kept[0], &k = kept[1], &v = kept[2], &attn = kept[3], &q = kept[4];
  qg.resize(size_t(rows * qg_row));
  k.resize(size_t(rows * kv_row));
  v.resize(size_t(rows * kv_row));
  attn.resize(size_t(rows * nh * hd));
  q.resize(size_t(rows * nh * hd));
  const Product qkv[] = {{&w.q_proj, qg.data()}, {&w.k_proj, k.data()}, {&w.v_proj, v.data()}};
  matmuls(pool, qkv, 3, x, rows);
  const float scale = 1.0f / std::sqrt(float(hd));

  // Each row's position in its own sequence.
  std::vector<int64_t> pos(static_cast<size_t>(rows));
  for (const CacheRows& seq : seqs)
    for (int64_t t = seq.row0; t < seq.row0 + seq.n; ++t) pos[size_t(t)] = seq.pos0 + (t - seq.row0);

  // Per row and independent of the others: q/k norms and rotary.
  pool.parallel_for(rows, [&](int64_t t0, int64_t t1) {
    std::vector<float> cs(size_t(rd / 2)), sn(size_t(rd / 2));
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < rd / 2; ++i) {
        float f = float(pos[size_t(t)]) * rope_inv_freq[i];  // fp32 angle, as the reference computes it
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
    for (int64_t h = 0; h < nh; ++h) simd::sigmoid_mul(at + h * hd, qgt + h * 2 * hd + hd, hd);
  };

  // Work items over every sequence's own cache. Full retention: the
  // sequence's keys and values go in first, then each of its tokens is an
  // item attending over its causal prefix (the same sums as token by token).
  // Windows and eviction policies: the whole sequence is one item, token by
  // token through its cache (an append can overwrite or evict what an earlier
  // token attended to). Items of different sequences are independent.
  struct Item { int64_t seq, t, prefix; };  // prefix < 0: the whole sequence
  std::vector<Item> items;
  for (int64_t s = 0; s < int64_t(seqs.size()); ++s) {
    const CacheRows& seq = seqs[size_t(s)];
    KvCache& cache = *seq.cache;
    // A single-token step is decoding: snapkv compresses the prompt now.
    if (seq.n == 1) cache.begin_decode();
    // fp8 channel: the keys are rounded against the queries that read them;
    // this chunk's queries exist before its keys are written.
    if (cache.wants_query_moments()) cache.add_query_moments(q.data() + seq.row0 * nh * hd, seq.n, nh);
    if (cache.supports_prefix_attention()) {
      cache.append_chunk(pos.data() + seq.row0, seq.n, k.data() + seq.row0 * kv_row, v.data() + seq.row0 * kv_row,
                         pool);
      if (cache.observes_queries())  // snapkv: the prompt's last queries choose what it keeps
        for (int64_t t = std::max(seq.row0, seq.row0 + seq.n - KvConfig::kSnapObserved); t < seq.row0 + seq.n; ++t)
          cache.observe_query(q.data() + t * nh * hd, nh, scale);
      const int64_t before = cache.size() - seq.n;
      // Longest prefixes first, so the threads that claim the last (shortest) finish together.
      for (int64_t i = seq.n - 1; i >= 0; --i) items.push_back({s, seq.row0 + i, before + i + 1});
    } else {
      items.push_back({s, seq.row0, -1});
    }
  }
  pool.parallel_for(int64_t(items.size()), [&](int64_t i0, int64_t i1) {
    thread_local KvCache::AttendScratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[size_t(i)];
      const CacheRows& seq = seqs[size_t(it.seq)];
      KvCache& cache = *seq.cache;
      if (it.prefix >= 0) {
        cache.attend_prefix(q.data() + it.t * nh * hd, nh, scale, attn.data() + it.t * nh * hd, it.prefix, scratch);
        gate(it.t);
        continue;
      }
      for (int64_t t = seq.row0; t < seq.row0 + seq.n; ++t) {
        cache.append(pos[size_t(t)], k.data() + t * kv_row, v.data() + t * kv_row);
        cache.attend(q.data() + t * nh * hd, nh, scale, attn.data() + t * nh * hd);
        gate(t);
      }
    }
  });
  // fp8 channel: the query moments' factors served this chunk's keys; the
  // sequence keeps the moments only (the next chunk adds queries anyway).
  for (const CacheRows& seq : seqs)
    if (seq.cache->wants_query_moments()) seq.cache->drop_query_factors();
  matmul(pool, w.o_proj, attn.data(), rows, out);
}

}  // namespace

void gated_attention_mixer(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq, int slot,
                           const std::vector<SequenceRows>& seqs, const float* x, int64_t rows, float* out,
                           ThreadPool& pool) {
  std::vector<CacheRows> caches;
  for (const SequenceRows& seq : seqs) caches.push_back({&seq.state->kv[size_t(slot)], seq.state->pos, seq.row0, seq.n});
  attention_over(c, w, rope_inv_freq, caches, x, rows, out, pool);
}

void gated_attention_mixer(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq,
                           KvCache& cache, int64_t pos0, const float* x, int64_t n, float* out, ThreadPool& pool) {
  attention_over(c, w, rope_inv_freq, {{&cache, pos0, 0, n}}, x, n, out, pool);
}

}  // namespace flashmoe::cpu
