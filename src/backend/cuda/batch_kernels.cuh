// The decode step's per-sequence kernels over a batch of sequences (one
// token each, continuous batching): blockIdx.y picks the sequence, whose
// arguments (its own conv / delta-rule state, KV cache, position) come from
// an array in device memory; the bodies are the decode step's own
// (delta.cuh, delta_cluster.cuh, attention.cuh), so every KV format and
// retention policy behaves as in a single-sequence step. Launched with PDL
// (Prefill::pdl(); under the profile without, where their waits are no-ops).
#pragma once
#include "backend/cuda/attention.cuh"
#include "backend/cuda/delta.cuh"
#include "backend/cuda/delta_cluster.cuh"
#include "backend/cuda/delta_staged.cuh"

namespace flashmoe::cuda {

// Conv1d + SiLU of sequence b: its projection row u + b * ustride, its
// state states[b], its output row out + b * C.
static __global__ void conv_batch_kernel(const float* __restrict__ u, int ustride, int C, int K,
                                         const float* __restrict__ taps, float* const* states, float* __restrict__ out) {
  const int b = blockIdx.y;
  conv_body(u + size_t(b) * ustride, C, K, taps, states[b], out + size_t(b) * C);
}

template <int DK, int SPLIT>
__global__ void delta_batch_kernel(const DeltaArgs* as) {
  const DeltaArgs a = as[blockIdx.y];
  delta_body<DK, SPLIT>(a);
}

template <int DK, int CPB, int PARTS>
__global__ void __launch_bounds__(CPB * PARTS) delta_cluster_batch_kernel(const DeltaArgs* as) {
  const DeltaArgs a = as[blockIdx.y];
  delta_cluster_body<DK, CPB, PARTS>(a);
}

// A verify pass (step_batch over consecutive tokens of one sequence): the
// rows' conv1d + SiLU in order, a thread per channel, the arithmetic of
// conv_body; the window after row t goes to states[t] (the one before row
// 0 is read from states[n - 1], the sequence's state, which the last row
// leaves), so CudaModel::take_back finds the state after any row.
static __global__ void conv_verify_kernel(const float* __restrict__ u, int ustride, int C, int K,
                                          const float* __restrict__ taps, float* const* states, float* __restrict__ out,
                                          int n) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = ch < C;  // K <= kConvRegTaps: Prefill::unsupported
  const size_t at = size_t(ch) * (K - 1);
  // The taps and the window before row 0 are known before the wait
  // (weights, and the state the last step left): into registers first.
  float tp[kConvRegTaps], st[kConvRegTaps];
  if (live) conv_window_load(tp, st, taps + size_t(ch) * K, states[n - 1] + at, K);
  pdl_wait();  // every thread, as in conv_body: the kernel must not end before the one before it
  pdl_trigger();
  if (!live) return;
  for (int t = 0; t < n; ++t)
    out[size_t(t) * C + ch] = siluf_(conv_window_step(tp, st, K, u[size_t(t) * ustride + ch], states[t] + at));
}

// The same for the delta rule: as[t] holds row t's inputs, output and
// where the state after it goes (as[n - 1].S: the sequence's state, read
// before row 0 and, as in delta_cluster_body, before the PDL wait: the last
// step left it); each thread's state rows stay in registers from row to row.
template <int DK, int CPB, int PARTS>
__global__ void __launch_bounds__(CPB * PARTS) delta_cluster_verify_kernel(const DeltaArgs* as, int n) {
  const DeltaArgs& last = as[n - 1];
  const DeltaClusterPlace<DK, CPB, PARTS> p(last.dv);
  float s[DK / PARTS];
#pragma unroll
  for (int i = 0; i < DK / PARTS; ++i) s[i] = last.S[p.offset + size_t(i) * last.dv];
  const float nwj = last.norm_w[p.j], dtb = last.dt_bias[p.h], nea = last.neg_exp_A[p.h];  // weights: before the wait too
  pdl_wait();
  pdl_trigger();
  for (int t = 0; t < n; ++t) {
    const DeltaArgs a = as[t];
    delta_cluster_token<DK, CPB, PARTS>(a, p, s, a.S + p.offset, nwj, dtb, nea);
  }
}

static __global__ void attn_prep_batch_kernel(const AttnPrepArgs* as) { attn_prep_body(as[blockIdx.y], 0); }

template <int KVT>
__global__ void __launch_bounds__(256) attn_batch_kernel(const AttnArgs* as) {
  const AttnArgs a = as[blockIdx.y];
  attn_body<KVT>(a);
}

// h2o / tova scores of one sequence (h2o_acc_kernel's arguments).
struct H2oAccArgs {
  KvLayer kv;
  const float* scores;
  const int* pos;
};

static __global__ void h2o_acc_batch_kernel(const H2oAccArgs* as, int nh) {
  const H2oAccArgs a = as[blockIdx.y];
  h2o_acc_body(a.kv, a.scores, nh, a.pos);
}

// out[r] = the argmax of logits row r ([V], ties: the lower id, all NaN: 0,
// as argmax_kernel and core/argmax.h); grid: one block per row.
static __global__ void argmax_rows_kernel(const float* __restrict__ logits, int V, int* __restrict__ out) {
  const int bi = block_argmax(logits + size_t(blockIdx.x) * V, V);
  if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

// A verify pass: the sequence's position (*pos) after its rows (rows: their positions).
static __global__ void verify_position_kernel(int* const* pos, const int* rows, int n) {
  pdl_wait();  // under PDL (as advance_positions_kernel): the kernel before has finished
  pdl_trigger();
  **pos = rows[n - 1] + 1;
}

// Every sequence's position one further (the decode step's advance_kernel).
static __global__ void advance_positions_kernel(int* const* pos, int n) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) ++*pos[i];
}

}  // namespace flashmoe::cuda
