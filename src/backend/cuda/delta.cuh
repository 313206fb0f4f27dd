// The GatedDeltaNet decode step: causal conv1d + SiLU, and the delta-rule
// recurrence with its gated RMS norm, one block per value head
// (delta_cluster.cuh: a cluster of blocks per head where the shapes allow).
#pragma once
#include "backend/cuda/common.cuh"

namespace flashmoe::cuda {

// Conv kernels of up to kConvRegTaps taps keep a channel's taps and window
// in registers (conv_body; the batched prefill takes no longer ones).
constexpr int kConvRegTaps = 8;

// A channel's taps tp[0..K) and previous inputs st[0..K-1) (oldest first)
// into registers, zeros past them.
__device__ __forceinline__ void conv_window_load(float (&tp)[kConvRegTaps], float (&st)[kConvRegTaps],
                                                 const float* taps, const float* prev, int K) {
#pragma unroll
  for (int j = 0; j < kConvRegTaps; ++j) {
    tp[j] = j < K ? taps[j] : 0.f;
    st[j] = j < K - 1 ? prev[j] : 0.f;
  }
}

// Input v through the window conv_window_load filled: returns the
// convolution before the SiLU (the newest input's tap first, then the
// previous inputs oldest first, as conv_body's memory path sums them),
// shifts v into st and stores the new window at prev[0..K-1).
__device__ __forceinline__ float conv_window_step(const float (&tp)[kConvRegTaps], float (&st)[kConvRegTaps], int K,
                                                  float v, float* prev) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kConvRegTaps; ++j)
    if (j == K - 1) acc = tp[j] * v;
#pragma unroll
  for (int j = 0; j < kConvRegTaps; ++j)
    if (j < K - 1) acc += tp[j] * st[j];
#pragma unroll
  for (int j = 0; j + 1 < kConvRegTaps; ++j)
    if (j + 1 < K - 1) st[j] = st[j + 1];
#pragma unroll
  for (int j = 0; j < kConvRegTaps; ++j) {
    if (j == K - 2) st[j] = v;
    if (j < K - 1) prev[j] = st[j];
  }
  return acc;
}

// GatedDeltaNet causal depthwise conv (kernel K) + SiLU over C channels.
// state: [C][K-1] previous inputs.
__device__ __forceinline__ void conv_body(const float* __restrict__ u, int C, int K, const float* __restrict__ taps,
                                          float* __restrict__ state, float* __restrict__ out) {
  // The taps and the previous inputs are known before the wait (weights, and
  // this layer's state from the last step): into registers first.
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  const bool reg = ch < C && K <= kConvRegTaps;
  float tp[kConvRegTaps], st[kConvRegTaps];
  if (reg) conv_window_load(tp, st, taps + size_t(ch) * K, state + size_t(ch) * (K - 1), K);
  pdl_wait();
  pdl_trigger();
  if (ch >= C) return;
  float* sp = state + size_t(ch) * (K - 1);
  const float v = u[ch];
  if (reg) {
    out[ch] = siluf_(conv_window_step(tp, st, K, v, sp));
    return;
  }
  const float* tpp = taps + size_t(ch) * K;
  float acc = tpp[K - 1] * v;
  for (int j = 0; j < K - 1; ++j) acc += tpp[j] * sp[j];
  for (int j = 0; j + 1 < K - 1; ++j) sp[j] = sp[j + 1];
  if (K > 1) sp[K - 2] = v;
  out[ch] = siluf_(acc);
}

static __global__ void conv_kernel(const float* __restrict__ u, int C, int K, const float* __restrict__ taps,
                                   float* __restrict__ state, float* __restrict__ out) {
  conv_body(u, C, K, taps, state, out);
}

struct DeltaArgs {
  const float* conv;  // [C]: q [nk*dk], k [nk*dk], v [nv*dv] (after conv + silu)
  const float* proj;  // projection output: z at zoff [nv*dv], b at boff [nv], a at aoff [nv]
  int zoff, boff, aoff;
  const float* dt_bias;
  const float* neg_exp_A;
  const float* norm_w;  // [dv]
  float* S;             // [nv][dk][dv]
  float* out;           // [nv*dv]
  int nk, nv, dk, dv;
  float eps;
  // Value head h reads key head h % nk (llama.cpp's tiled order of Qwen3.5
  // GGUF files) instead of h / (nv / nk) (LinearAttentionWeights::v_heads_tiled).
  int tiled = 0;
};

// One block per value head. DK > 0: SPLIT threads per value column j, each
// holding DK/SPLIT rows of the state column in registers (blockDim = dv*SPLIT);
// DK == 0: generic, one thread per column, state read and written in memory.
template <int DK, int SPLIT>
__device__ __forceinline__ void delta_body(const DeltaArgs& a) {
  extern __shared__ float sm[];
  float* q = sm;
  float* k = sm + a.dk;
  const int h = blockIdx.x, r = a.nv / a.nk, g = a.tiled ? h % a.nk : h / r, dk = a.dk, dv = a.dv;
  const int j = threadIdx.x / SPLIT, part = threadIdx.x % SPLIT;
  pdl_wait();
  pdl_trigger();
  float sq = 0.f, sk = 0.f;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    const float qi = a.conv[g * dk + i];
    const float ki = a.conv[a.nk * dk + g * dk + i];
    q[i] = qi;
    k[i] = ki;
    sq += qi * qi;
    sk += ki * ki;
  }
  sq = block_sum(sq);
  sk = block_sum(sk);
  const float rq = (1.0f / sqrtf(float(dk))) / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    q[i] *= rq;
    k[i] *= rk;
  }
  __syncthreads();
  const float beta = sigmoidf_(a.proj[a.boff + h]);
  const float decay = expf(a.neg_exp_A[h] * softplusf_(a.proj[a.aoff + h] + a.dt_bias[h]));
  float o = 0.f;
  const bool active = j < dv;
  float* S = a.S + size_t(h) * dk * dv + (active ? j : 0);
  const int vch = 2 * a.nk * dk + h * dv + j;
  const float v = active ? a.conv[vch] : 0.f;
  if constexpr (DK > 0) {
    constexpr int R = DK / SPLIT;
    const int i0 = part * R;
    float s[R];
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] = active ? S[size_t(i0 + i) * dv] * decay : 0.f;
      m += k[i0 + i] * s[i];
    }
#pragma unroll
    for (int o2 = 1; o2 < SPLIT; o2 <<= 1) m += __shfl_xor_sync(0xffffffffu, m, o2);
    const float d = (v - m) * beta;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] += k[i0 + i] * d;
      o += q[i0 + i] * s[i];
      if (active) S[size_t(i0 + i) * dv] = s[i];
    }
#pragma unroll
    for (int o2 = 1; o2 < SPLIT; o2 <<= 1) o += __shfl_xor_sync(0xffffffffu, o, o2);
  } else if (active) {
    float m = 0.f;
    for (int i = 0; i < dk; ++i) {
      const float si = S[size_t(i) * dv] * decay;
      S[size_t(i) * dv] = si;
      m += k[i] * si;
    }
    const float d = (v - m) * beta;
    for (int i = 0; i < dk; ++i) {
      const float si = S[size_t(i) * dv] + k[i] * d;
      S[size_t(i) * dv] = si;
      o += q[i] * si;
    }
  }
  const float ss = block_sum(active && part == 0 ? o * o : 0.f);
  if (active && part == 0) {
    const float rn = 1.0f / sqrtf(ss / float(dv) + a.eps);
    a.out[h * dv + j] = o * rn * a.norm_w[j] * siluf_(a.proj[a.zoff + h * dv + j]);
  }
}
template <int DK, int SPLIT>
__global__ void delta_kernel(DeltaArgs a) {
  delta_body<DK, SPLIT>(a);
}

}  // namespace flashmoe::cuda
