// The GatedDeltaNet decode step spread over a cluster of blocks per value
// head (v14 in bench/NOTES-cuda.md). delta_kernel runs
// one block per head: 32 SMs for the 35B, each streaming a 64 KB state
// column block in and out, after the wait. Here:
//  - each block owns CPB value columns of one head (a cluster of dv/CPB
//    blocks per head: 128 SMs for the 35B), PARTS row groups of the state
//    per column, lanes on consecutive columns (coalesced);
//  - the state is the previous step's, so it is read into registers before
//    the PDL wait, while the projection before still runs (the per-head
//    weights too);
//  - the gated RMS norm over the head's dv outputs sums the blocks' squares
//    through distributed shared memory (cluster barrier), in rank order, so
//    every block gets the same scale.
#pragma once
#include <cooperative_groups.h>

#include "backend/cuda/delta.cuh"

namespace flashmoe::cuda {

// Warp 0: q, warp 1: k of value head h's key head (channels of a.conv),
// l2-normed (q also by 1/sqrt(DK)), into shared q[DK], k[DK]; the other
// warps nothing. After the wait; the caller syncs before reading them.
template <int DK>
__device__ __forceinline__ void delta_qk_normed(const DeltaArgs& a, int h, float* q, float* k) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = a.tiled ? h % a.nk : h / (a.nv / a.nk);
  if (warp >= 2) return;
  const int ch0 = warp * a.nk * DK + g * DK;
  float v[DK / 32], ss = 0.f;
#pragma unroll
  for (int i = 0; i < DK / 32; ++i) {
    v[i] = a.conv[ch0 + i * 32 + lane];
    ss += v[i] * v[i];
  }
  ss = warp_sum(ss);
  const float r = warp ? 1.0f / sqrtf(ss + 1e-6f) : (1.0f / sqrtf(float(DK))) / sqrtf(ss + 1e-6f);
  float* dst = warp ? k : q;
#pragma unroll
  for (int i = 0; i < DK / 32; ++i) dst[i * 32 + lane] = v[i] * r;
}

// This thread's place in delta_cluster_body's layout: value head h, its
// column j, the first of its R = DK / PARTS state rows (offset: of that
// state element in a [nv][dk][dv] state).
template <int DK, int CPB, int PARTS>
struct DeltaClusterPlace {
  static_assert(DK % PARTS == 0 && DK % 32 == 0 && CPB * PARTS >= 64 && CPB <= 32, "delta_cluster_kernel shape");
  static constexpr int R = DK / PARTS;  // state rows per thread
  int CL, h, rank, col, part, j;
  size_t offset;
  __device__ __forceinline__ explicit DeltaClusterPlace(int dv) {
    CL = dv / CPB;
    h = blockIdx.x / CL, rank = blockIdx.x % CL;
    col = threadIdx.x % CPB, part = threadIdx.x / CPB;
    j = rank * CPB + col;
    offset = (size_t(h) * DK + size_t(part) * R) * dv + j;
  }
};

// One token of the delta rule on this thread's state rows s (registers),
// which end up stored at S (this thread's first element; rows dv apart),
// and its gated-normed output; nwj, dtb, nea: the column's norm weight, the
// head's dt bias and -exp(A).
template <int DK, int CPB, int PARTS>
__device__ __forceinline__ void delta_cluster_token(const DeltaArgs& a, const DeltaClusterPlace<DK, CPB, PARTS>& p,
                                                    float (&s)[DK / PARTS], float* S, float nwj, float dtb, float nea) {
  constexpr int R = DK / PARTS;
  __shared__ float q[DK], k[DK];
  __shared__ float red[PARTS][CPB];
  __shared__ float sq_block;
  const int dv = a.dv, CL = p.CL, h = p.h, col = p.col, part = p.part, j = p.j;
  delta_qk_normed<DK>(a, h, q, k);
  const float beta = sigmoidf_(a.proj[a.boff + h]);
  const float decay = expf(nea * softplusf_(a.proj[a.aoff + h] + dtb));
  const int vch = 2 * a.nk * DK + h * dv + j;
  const float v = a.conv[vch];
  __syncthreads();
  const int i0 = part * R;
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] *= decay;
    m += k[i0 + i] * s[i];
  }
  red[part][col] = m;
  __syncthreads();
  m = 0.f;
#pragma unroll
  for (int p = 0; p < PARTS; ++p) m += red[p][col];
  const float d = (v - m) * beta;
  float o = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] += k[i0 + i] * d;
    o += q[i0 + i] * s[i];
    S[size_t(i) * dv] = s[i];
  }
  __syncthreads();  // every thread has read red
  red[part][col] = o;
  __syncthreads();
  if (part == 0) {
    o = 0.f;
#pragma unroll
    for (int p = 0; p < PARTS; ++p) o += red[p][col];
    red[0][col] = o * o;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int c = 0; c < CPB; ++c) t += red[0][c];
    sq_block = t;
  }
  float ss;
  if (CL == 1) {
    __syncthreads();
    ss = sq_block;
  } else {
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    ss = 0.f;
    for (int r = 0; r < CL; ++r) ss += *cl.map_shared_rank(&sq_block, r);
    cl.sync();  // no block leaves while another still reads its square sum
  }
  if (part == 0) {
    const float rn = 1.0f / sqrtf(ss / float(dv) + a.eps);
    a.out[h * dv + j] = o * rn * nwj * siluf_(a.proj[a.zoff + h * dv + j]);
  }
}

template <int DK, int CPB, int PARTS>
__device__ __forceinline__ void delta_cluster_body(const DeltaArgs& a) {
  const DeltaClusterPlace<DK, CPB, PARTS> p(a.dv);
  float* S = a.S + p.offset;
  float s[DK / PARTS];
#pragma unroll
  for (int i = 0; i < DK / PARTS; ++i) s[i] = S[size_t(i) * a.dv];
  const float nwj = a.norm_w[p.j], dtb = a.dt_bias[p.h], nea = a.neg_exp_A[p.h];  // weights: before the wait too
  pdl_wait();
  pdl_trigger();
  delta_cluster_token<DK, CPB, PARTS>(a, p, s, S, nwj, dtb, nea);
}
template <int DK, int CPB, int PARTS>
__global__ void __launch_bounds__(CPB * PARTS) delta_cluster_kernel(DeltaArgs a) {
  delta_cluster_body<DK, CPB, PARTS>(a);
}

}  // namespace flashmoe::cuda
