// The decode step's per-sequence kernels over a batch of sequences (one
// token each, continuous batching): blockIdx.y picks the sequence, whose
// arguments (its own conv / delta-rule state, KV cache, position) come from
// an array in device memory; the bodies are the decode step's own
// (delta.cuh, delta_cluster.cuh, attention.cuh), so every KV format and
// retention policy behaves as in a single-sequence step. Launched with PDL
// where DecodeOptions::batch_pdl (else their waits are no-ops).
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

// Every sequence's position one further (the decode step's advance_kernel).
static __global__ void advance_positions_kernel(int* const* pos, int n) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) ++*pos[i];
}

}  // namespace flashmoe::cuda
