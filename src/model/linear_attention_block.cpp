// GatedDeltaNet: projections, causal depthwise conv + SiLU, per-value-head
// delta-rule recurrence, gated RMSNorm, output projection. The projections
// run over the whole chunk at once; the recurrence runs token by token, with
// the value heads (independent of each other) spread over the threads.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/gated_delta.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "model/blocks.h"

namespace flashmoe {

namespace {

// Qwen3-Next groups qkvz and ba per key head g: [q_g, k_g, v_g (r*dv), z_g (r*dv)]
// and [b_g (r), a_g (r)]. Rewrites one token's outputs into the Qwen3.5
// order: qkv = [q (all heads), k, v], z, b, a.
void ungroup_token(const ModelConfig& c, const float* qkvz, const float* ba, float* qkv, float* z,
                   float* b, float* a) {
  const int64_t nk = c.lin_num_k_heads, dk = c.lin_k_dim, dv = c.lin_v_dim;
  const int64_t r = c.lin_num_v_heads / nk;
  const int64_t group = 2 * dk + 2 * r * dv;
  for (int64_t g = 0; g < nk; ++g) {
    const float* src = qkvz + g * group;
    std::copy(src, src + dk, qkv + g * dk);
    std::copy(src + dk, src + 2 * dk, qkv + nk * dk + g * dk);
    std::copy(src + 2 * dk, src + 2 * dk + r * dv, qkv + 2 * nk * dk + g * r * dv);
    std::copy(src + 2 * dk + r * dv, src + group, z + g * r * dv);
    std::copy(ba + g * 2 * r, ba + g * 2 * r + r, b + g * r);
    std::copy(ba + g * 2 * r + r, ba + (g + 1) * 2 * r, a + g * r);
  }
}

}  // namespace

void linear_attention_block(const ModelConfig& c, const LinearAttentionWeights& w,
                            std::vector<float>& conv_state, std::vector<float>& ssm_state,
                            const float* x, int64_t n, float* out, ThreadPool& pool) {
  const int64_t nk = c.lin_num_k_heads, nv = c.lin_num_v_heads, dk = c.lin_k_dim, dv = c.lin_v_dim;
  const int64_t C = c.lin_conv_dim(), K = c.conv_kernel, r = nv / nk;
  std::vector<float> qkv(size_t(n * C)), z(size_t(n * nv * dv)), b(size_t(n * nv)), a(size_t(n * nv));

  if (w.grouped) {
    const int64_t qkvz_row = w.in_qkvz.rows;
    std::vector<float> qkvz(size_t(n * qkvz_row)), ba(size_t(n * 2 * nv));
    cpu::matmul(pool, w.in_qkvz, x, n, qkvz.data());
    cpu::matmul(pool, w.in_ba, x, n, ba.data());
    for (int64_t t = 0; t < n; ++t)
      ungroup_token(c, qkvz.data() + t * qkvz_row, ba.data() + t * 2 * nv, qkv.data() + t * C,
                    z.data() + t * nv * dv, b.data() + t * nv, a.data() + t * nv);
  } else {
    cpu::matmul(pool, w.in_qkv, x, n, qkv.data());
    cpu::matmul(pool, w.in_z, x, n, z.data());
    cpu::matmul(pool, w.in_b, x, n, b.data());
    cpu::matmul(pool, w.in_a, x, n, a.data());
  }

  // Causal depthwise conv over time, state = the last K-1 inputs per channel.
  std::vector<float> conv_out(size_t(n * C));
  pool.parallel_for(C, [&](int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch) {
      float* st = conv_state.data() + ch * (K - 1);
      const float* taps = w.conv.data() + ch * K;
      for (int64_t t = 0; t < n; ++t) {
        float u = qkv[t * C + ch];
        float acc = taps[K - 1] * u;
        for (int64_t j = 0; j < K - 1; ++j) acc += taps[j] * st[j];
        for (int64_t j = 0; j + 1 < K - 1; ++j) st[j] = st[j + 1];
        if (K > 1) st[K - 2] = u;
        conv_out[t * C + ch] = cpu::silu(acc);
      }
    }
  }, 64);

  // q, k: L2-normalised per key head (q also scaled by 1/sqrt(dk)).
  const float qscale = 1.0f / std::sqrt(float(dk));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < nk; ++g) {
      cpu::l2norm(conv_out.data() + t * C + g * dk, dk, 1e-6f, qscale);
      cpu::l2norm(conv_out.data() + t * C + nk * dk + g * dk, dk, 1e-6f, 1.0f);
    }

  std::vector<float> o(size_t(n * nv * dv));
  pool.parallel_for(nv, [&](int64_t h0, int64_t h1) {
    std::vector<float> scratch(static_cast<size_t>(dv)), oh(static_cast<size_t>(dv));
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t g = h / r;
      float* S = ssm_state.data() + h * dk * dv;
      for (int64_t t = 0; t < n; ++t) {
        const float* row = conv_out.data() + t * C;
        const float beta = cpu::sigmoid(b[t * nv + h]);
        const float gate = w.neg_exp_A[h] * cpu::softplus(a[t * nv + h] + w.dt_bias[h]);
        cpu::gated_delta_step(S, row + g * dk, row + nk * dk + g * dk, row + 2 * nk * dk + h * dv,
                              std::exp(gate), beta, dk, dv, oh.data(), scratch.data());
        cpu::rmsnorm_gated(oh.data(), w.norm.data(), z.data() + (t * nv + h) * dv, dv, c.rms_norm_eps,
                           o.data() + (t * nv + h) * dv);
      }
    }
  });
  cpu::matmul(pool, w.out_proj, o.data(), n, out);
}

}  // namespace flashmoe
