// GatedDeltaNet: projections, causal depthwise conv + SiLU, per-value-head
// delta-rule recurrence, gated RMSNorm, output projection. The projections
// run over all the step's rows at once; the conv and the recurrence run
// token by token on each sequence's own state, with (sequence, channel) and
// (sequence, value head) pairs, independent of each other, spread over the
// threads.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/gated_delta.h"
#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "core/aligned.h"
#include "core/simd.h"

namespace flashmoe::cpu {
namespace {

// One token of the causal depthwise conv for nc channels of any kernel
// width k but 4 (which simd::conv4_token takes), each straight from its
// taps [ch][k] and state [ch][k-1] (shifted, u appended); y gets the sums
// before the SiLU: taps[k-1] * u, then + taps[j] * state[j], j ascending
// (the blocked path's order).
void conv_token(const float* __restrict taps, float* __restrict st, const float* __restrict u, int64_t nc, int64_t K,
                float* __restrict y) {
  for (int64_t ch = 0; ch < nc; ++ch) {
    const float* tc = taps + ch * K;
    float* sc = st + ch * (K - 1);
    float acc = tc[K - 1] * u[ch];
    for (int64_t j = 0; j < K - 1; ++j) acc += tc[j] * sc[j];
    for (int64_t j = 0; j + 1 < K - 1; ++j) sc[j] = sc[j + 1];
    if (K > 1) sc[K - 2] = u[ch];
    y[ch] = acc;
  }
}

}  // namespace

void gated_delta_net_mixer(const ModelConfig& c, const LinearAttentionWeights& w, int slot,
                           const std::vector<SequenceRows>& seqs, const float* x, int64_t rows, float* out,
                           ThreadPool& pool) {
  const int64_t nk = c.lin_num_k_heads, nv = c.lin_num_v_heads, dk = c.lin_k_dim, dv = c.lin_v_dim;
  const int64_t C = c.lin_conv_dim(), K = c.conv_kernel, r = nv / nk;
  const int64_t S = int64_t(seqs.size());
  // Kept on this thread across calls (each element is written before it is
  // read): a prompt chunk's buffers are megabytes, and clearing fresh ones
  // (page faults included) was serial time between the parallel loops. The
  // names are references so that the loops' workers use this thread's.
  thread_local AlignedFloats kept[6];
  thread_local std::vector<std::vector<float>> kept_outs;
  AlignedFloats &qkv = kept[0], &z = kept[1], &b = kept[2], &a = kept[3], &conv_out = kept[4], &o = kept[5];
  std::vector<std::vector<float>>& outs = kept_outs;
  qkv.resize(size_t(rows * C));
  z.resize(size_t(rows * nv * dv));
  b.resize(size_t(rows * nv));
  a.resize(size_t(rows * nv));

  // The stored projections (one product each), then each token's outputs
  // in the order q, k, v, z, b, a (SplitProjection resolves the layout).
  const SplitProjection& in = w.in_proj;
  outs.resize(in.stored.size());
  std::vector<Product> products;
  for (size_t i = 0; i < in.stored.size(); ++i) {
    outs[i].resize(size_t(rows * in.stored[i].rows));
    products.push_back({&in.stored[i], outs[i].data()});
  }
  matmuls(pool, products.data(), products.size(), x, rows);
  const int64_t P = in.rows();
  pool.parallel_for(rows, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(static_cast<size_t>(P));
    std::vector<const float*> at(outs.size());
    for (int64_t t = t0; t < t1; ++t) {
      for (size_t i = 0; i < outs.size(); ++i) at[i] = outs[i].data() + t * in.stored[i].rows;
      in.gather(at.data(), row.data());
      const float* y = row.data();
      std::copy(y, y + C, qkv.data() + t * C);
      std::copy(y + C, y + C + nv * dv, z.data() + t * nv * dv);
      std::copy(y + C + nv * dv, y + C + nv * dv + nv, b.data() + t * nv);
      std::copy(y + C + nv * dv + nv, y + P, a.data() + t * nv);
    }
  }, kRowGrain);

  // Causal depthwise conv over time, state = the last K-1 inputs per
  // channel. Work items: (sequence, block of channels). Within one, time
  // runs outer and the block's channels inner, contiguous in qkv and
  // conv_out, with the block's taps and state copied to [tap][channel] so
  // the inner loops are plain vector loops (one channel at a time strode
  // through memory a row apart). Each channel's sum is formed in the same
  // order as before: taps[K-1] * u, then + taps[j] * state[j], j ascending.
  conv_out.resize(size_t(rows * C));
  constexpr int64_t kConvBlock = 64;
  const int64_t blocks = (C + kConvBlock - 1) / kConvBlock;
  // A decode step's conv is a few thousand multiply-adds a sequence: below
  // ~32k in all it stays on this thread (a parallel region cost more).
  const int64_t conv_grain = rows * C * K < (1 << 15) ? S * blocks : 1;
  pool.parallel_for(S * blocks, [&](int64_t i0, int64_t i1) {
    std::vector<float> tap(size_t(K * kConvBlock)), win(size_t(std::max<int64_t>(K - 1, 1) * kConvBlock));
    float acc[kConvBlock];
    for (int64_t i = i0; i < i1; ++i) {
      const SequenceRows& seq = seqs[size_t(i / blocks)];
      const int64_t c0 = (i % blocks) * kConvBlock, nc = std::min(kConvBlock, C - c0);
      float* st = seq.state->conv[size_t(slot)].data() + c0 * (K - 1);
      const float* taps = w.conv.data() + c0 * K;
      if (seq.n < K) {
        // A few tokens (a decode step's one): straight from the stored taps
        // and state (the models' K = 4 sixteen channels at a time, session
        // 25). The copies to [tap][channel] and back below pay for a
        // prompt; for one token they were ~16 strided moves a channel for K
        // multiply-adds (bench/NOTES.md, "Session 24").
        for (int64_t t = seq.row0; t < seq.row0 + seq.n; ++t) {
          float* y = conv_out.data() + t * C + c0;
          if (K == 4) simd::conv4_token(taps, st, qkv.data() + t * C + c0, nc, y);
          else conv_token(taps, st, qkv.data() + t * C + c0, nc, K, y);
          simd::silu(y, nc);
        }
        continue;
      }
      for (int64_t ch = 0; ch < nc; ++ch) {
        for (int64_t j = 0; j < K; ++j) tap[size_t(j * kConvBlock + ch)] = taps[ch * K + j];
        for (int64_t j = 0; j < K - 1; ++j) win[size_t(j * kConvBlock + ch)] = st[ch * (K - 1) + j];
      }
      for (int64_t t = seq.row0; t < seq.row0 + seq.n; ++t) {
        const float* u = qkv.data() + t * C + c0;
        const float* last = tap.data() + (K - 1) * kConvBlock;
        for (int64_t ch = 0; ch < nc; ++ch) acc[ch] = last[ch] * u[ch];
        for (int64_t j = 0; j < K - 1; ++j) {
          const float* tj = tap.data() + j * kConvBlock;
          const float* sj = win.data() + j * kConvBlock;
          for (int64_t ch = 0; ch < nc; ++ch) acc[ch] += tj[ch] * sj[ch];
        }
        for (int64_t j = 0; j + 1 < K - 1; ++j)
          std::copy_n(win.data() + (j + 1) * kConvBlock, nc, win.data() + j * kConvBlock);
        if (K > 1) std::copy_n(u, nc, win.data() + (K - 2) * kConvBlock);
        float* y = conv_out.data() + t * C + c0;
        std::copy_n(acc, nc, y);
        simd::silu(y, nc);
      }
      for (int64_t ch = 0; ch < nc; ++ch)
        for (int64_t j = 0; j < K - 1; ++j) st[ch * (K - 1) + j] = win[size_t(j * kConvBlock + ch)];
    }
  }, conv_grain);

  // q, k: L2-normalised per key head (q also scaled by 1/sqrt(dk)).
  const float qscale = 1.0f / std::sqrt(float(dk));
  pool.parallel_for(rows, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < nk; ++g) {
        l2norm(conv_out.data() + t * C + g * dk, dk, 1e-6f, qscale);
        l2norm(conv_out.data() + t * C + nk * dk + g * dk, dk, 1e-6f, 1.0f);
      }
  }, kRowGrain);

  o.resize(size_t(rows * nv * dv));
  // The recurrence of a step updating fewer than ~64k state elements (a
  // few small heads, few sequences: coder-mini's 8 heads of 32 x 32 up to 7
  // sequences) stays on this thread: measured B = 1 +8%, B = 4 +4%, B = 8
  // even and B = 16 -5% against splitting it (bench/NOTES.md, "Session 23").
  const int64_t delta_grain = rows * nv * dk * dv < (1 << 16) ? S * nv : 1;
  pool.parallel_for(S * nv, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(static_cast<size_t>(dv)), oh(static_cast<size_t>(dv));
    for (int64_t i = i0; i < i1; ++i) {
      const SequenceRows& seq = seqs[size_t(i / nv)];
      const int64_t h = i % nv, g = w.key_head(h, nk, r);
      float* Sm = seq.state->ssm[size_t(slot)].data() + h * dk * dv;
      for (int64_t t = seq.row0; t < seq.row0 + seq.n; ++t) {
        const float* row = conv_out.data() + t * C;
        const float beta = sigmoid(b[t * nv + h]);
        const float gate = w.neg_exp_A[h] * softplus(a[t * nv + h] + w.dt_bias[h]);
        gated_delta_step(Sm, row + g * dk, row + nk * dk + g * dk, row + 2 * nk * dk + h * dv, std::exp(gate), beta,
                         dk, dv, oh.data(), scratch.data());
        rmsnorm_gated(oh.data(), w.norm.data(), z.data() + (t * nv + h) * dv, dv, c.rms_norm_eps,
                      o.data() + (t * nv + h) * dv);
      }
    }
  }, delta_grain);
  matmul(pool, w.out_proj, o.data(), rows, out);
}

}  // namespace flashmoe::cpu
