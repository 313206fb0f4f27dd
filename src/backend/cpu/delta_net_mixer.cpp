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

namespace flashmoe::cpu {

void gated_delta_net_mixer(const ModelConfig& c, const LinearAttentionWeights& w, int slot,
                           const std::vector<SequenceRows>& seqs, const float* x, int64_t rows, float* out,
                           ThreadPool& pool) {
  const int64_t nk = c.lin_num_k_heads, nv = c.lin_num_v_heads, dk = c.lin_k_dim, dv = c.lin_v_dim;
  const int64_t C = c.lin_conv_dim(), K = c.conv_kernel, r = nv / nk;
  const int64_t S = int64_t(seqs.size());
  std::vector<float> qkv(size_t(rows * C)), z(size_t(rows * nv * dv)), b(size_t(rows * nv)), a(size_t(rows * nv));

  // The stored projections (one product each), then each token's outputs
  // in the order q, k, v, z, b, a (SplitProjection resolves the layout).
  const SplitProjection& in = w.in_proj;
  std::vector<std::vector<float>> outs(in.stored.size());
  for (size_t i = 0; i < in.stored.size(); ++i) {
    outs[i].resize(size_t(rows * in.stored[i].rows));
    matmul(pool, in.stored[i], x, rows, outs[i].data());
  }
  const int64_t P = in.rows();
  std::vector<float> row(static_cast<size_t>(P));
  std::vector<const float*> at(outs.size());
  for (int64_t t = 0; t < rows; ++t) {
    for (size_t i = 0; i < outs.size(); ++i) at[i] = outs[i].data() + t * in.stored[i].rows;
    in.gather(at.data(), row.data());
    const float* y = row.data();
    std::copy(y, y + C, qkv.data() + t * C);
    std::copy(y + C, y + C + nv * dv, z.data() + t * nv * dv);
    std::copy(y + C + nv * dv, y + C + nv * dv + nv, b.data() + t * nv);
    std::copy(y + C + nv * dv + nv, y + P, a.data() + t * nv);
  }

  // Causal depthwise conv over time, state = the last K-1 inputs per channel.
  std::vector<float> conv_out(size_t(rows * C));
  pool.parallel_for(S * C, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const SequenceRows& seq = seqs[size_t(i / C)];
      const int64_t ch = i % C;
      float* st = seq.state->conv[size_t(slot)].data() + ch * (K - 1);
      const float* taps = w.conv.data() + ch * K;
      for (int64_t t = seq.row0; t < seq.row0 + seq.n; ++t) {
        float u = qkv[t * C + ch];
        float acc = taps[K - 1] * u;
        for (int64_t j = 0; j < K - 1; ++j) acc += taps[j] * st[j];
        for (int64_t j = 0; j + 1 < K - 1; ++j) st[j] = st[j + 1];
        if (K > 1) st[K - 2] = u;
        conv_out[t * C + ch] = silu(acc);
      }
    }
  }, 64);

  // q, k: L2-normalised per key head (q also scaled by 1/sqrt(dk)).
  const float qscale = 1.0f / std::sqrt(float(dk));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t g = 0; g < nk; ++g) {
      l2norm(conv_out.data() + t * C + g * dk, dk, 1e-6f, qscale);
      l2norm(conv_out.data() + t * C + nk * dk + g * dk, dk, 1e-6f, 1.0f);
    }

  std::vector<float> o(size_t(rows * nv * dv));
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
  });
  matmul(pool, w.out_proj, o.data(), rows, out);
}

}  // namespace flashmoe::cpu
