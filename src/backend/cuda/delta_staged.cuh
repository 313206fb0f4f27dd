// The delta rule of a batched decode step (continuous batching) with each
// head's state staged through shared memory: one block per (value head,
// sequence), blockIdx.y the sequence (batch_kernels.cuh).
//
// At B = 32 the 35B's delta rule moves 64 MiB of states in and 64 MiB out
// per layer. delta_cluster_body holds its 16 KB slice of a head in
// registers (76 per thread: 3 blocks, 48 KB of loads in flight per SM) and
// reached 28% of DRAM bandwidth (ncu, bench/NOTES-cuda.md, batch-more).
// Here the whole head's state (DK x dv fp32, 64 KB) goes global -> shared
// by cp.async, issued before the wait (the state is the previous step's),
// so the bytes in flight are bounded by shared memory (3 blocks, 192 KB
// per SM) instead of registers; the threads then read it twice from shared
// memory (k . S after the decay, then the update, q . S and the store).
//
// The arithmetic and its order are delta_cluster_body's (8 row groups of
// DK / 8 rows per column, summed in order; the gated norm's square sum over
// 32-column groups in order); the compiler's contractions differ, so the
// two agree to rounding, not bit for bit (measured: bench/NOTES-cuda.md).
#pragma once
#include "backend/cuda/delta_cluster.cuh"

namespace flashmoe::cuda {

constexpr int kStagedParts = 8;   // row groups per column (delta_cluster_body's PARTS)
constexpr int kStagedThreads = 4;  // threads per value column, kStagedParts / 4 row groups each

// Shared memory of a block: the state [DK][dv], q and k [DK], the partial sums [kStagedParts][dv].
inline size_t delta_staged_smem(int dk, int dv) {
  return size_t(dk) * dv * 4 + size_t(2 * dk) * 4 + size_t(kStagedParts) * dv * 4;
}

// Whether delta_staged_batch_kernel takes heads of dk x dv (blockDim dv * kStagedThreads).
inline bool delta_staged_fits(int dk, int dv, int max_smem) {
  return (dk == 128 || dk == 64 || dk == 32) && dv % 32 == 0 && dv * kStagedThreads <= 512 &&
         delta_staged_smem(dk, dv) <= size_t(max_smem);
}

// Grid (value heads, sequences), blockDim dv * kStagedThreads (up to 512),
// delta_staged_smem(DK, dv) bytes of dynamic shared memory.
template <int DK>
__global__ void __launch_bounds__(512, 3) delta_staged_batch_kernel(const DeltaArgs* as) {
  constexpr int R = DK / kStagedParts, SUB = kStagedParts / kStagedThreads;
  extern __shared__ __align__(16) float sm[];
  __shared__ float group_sq[32], sq_total;
  const DeltaArgs& a = as[blockIdx.y];
  const int dv = a.dv, h = blockIdx.x;
  float* st = sm;             // [DK][dv]
  float* q = st + DK * dv;    // [DK]
  float* k = q + DK;          // [DK]
  float* red = k + DK;        // [kStagedParts][dv]
  float* S = a.S + size_t(h) * DK * dv;
  for (int c = threadIdx.x; c < DK * dv / 4; c += blockDim.x) cp_async16(st + 4 * c, S + 4 * c);
  cp_async_commit();
  const int j = threadIdx.x % dv, t = threadIdx.x / dv;  // value column, and which SUB row groups
  const float nwj = a.norm_w[j], dtb = a.dt_bias[h], nea = a.neg_exp_A[h];  // weights: before the wait too
  pdl_wait();
  pdl_trigger();
  delta_qk_normed<DK>(a, h, q, k);
  const float beta = sigmoidf_(a.proj[a.boff + h]);
  const float decay = expf(nea * softplusf_(a.proj[a.aoff + h] + dtb));
  const float v = a.conv[2 * a.nk * DK + h * dv + j];
  cp_async_wait<0>();
  __syncthreads();
  // k . (decay S) per row group (delta_cluster_body's m of part p).
#pragma unroll
  for (int u = 0; u < SUB; ++u) {
    const int p = t * SUB + u;
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) m += k[p * R + i] * (st[(p * R + i) * dv + j] * decay);
    red[p * dv + j] = m;
  }
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int p = 0; p < kStagedParts; ++p) m += red[p * dv + j];
  const float d = (v - m) * beta;
  __syncthreads();  // every thread has read red
#pragma unroll
  for (int u = 0; u < SUB; ++u) {
    const int p = t * SUB + u;
    float o = 0.f;
#pragma unroll 4  // fully unrolled it spilled at 3 blocks per SM (40 registers)
    for (int i = 0; i < R; ++i) {
      const int row = p * R + i;
      float s = st[row * dv + j] * decay;
      s += k[row] * d;
      o += q[row] * s;
      S[size_t(row) * dv + j] = s;
    }
    red[p * dv + j] = o;
  }
  __syncthreads();
  float o = 0.f;
  if (t == 0) {
#pragma unroll
    for (int p = 0; p < kStagedParts; ++p) o += red[p * dv + j];
  }
  __syncthreads();  // every column's partial sums read before red[0] takes the squares
  if (t == 0) red[j] = o * o;
  __syncthreads();
  if (threadIdx.x < dv / 32) {  // delta_cluster_body's blocks of 32 columns, each summed in order
    float s = 0.f;
    for (int c = 0; c < 32; ++c) s += red[threadIdx.x * 32 + c];
    group_sq[threadIdx.x] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int r = 0; r < dv / 32; ++r) s += group_sq[r];
    sq_total = s;
  }
  __syncthreads();
  if (t == 0) {
    const float rn = 1.0f / sqrtf(sq_total / float(dv) + a.eps);
    a.out[h * dv + j] = o * rn * nwj * siluf_(a.proj[a.zoff + h * dv + j]);
  }
}

}  // namespace flashmoe::cuda
