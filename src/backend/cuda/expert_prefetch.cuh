// Copying a host-tier expert to VRAM during a MoE layer's mixer (tiered
// q4/q8 experts, DecodeOptions::prefetch_host_experts).
//
// Why: with experts in pinned host memory the decode step is bound by the
// host link, and the link idles while each layer's mixer (projections,
// conv, delta rule or attention: HBM work) runs, because the experts a
// layer reads are known only after its router, which follows its mixer.
// The router's input is the layer's input residual plus the mixer's
// output, so the router applied to the input residual alone ranks the
// experts nearly as the real pick will. At the start of each MoE layer a
// second stream (forked from the step, joined before the layer's expert
// kernels, so it is part of the captured graph) computes those predicted
// logits (predict_logits_kernel) and copies the host-tier expert they rank
// highest into a VRAM buffer (copy_ahead_kernel), while the mixer runs on
// the main stream. If the pick then chooses it, the expert kernels read the
// VRAM copy (the same bytes: the results are bitwise unchanged); if not,
// the copy only used link time the mixer left idle (and a few SMs).
//
// The prediction reads the residual x while the main stream's mixer runs;
// the mixer's output projection adds into x only after its in-projection,
// conv and delta/attention kernels, long after the prediction has read it.
// Were the prediction ever late, it would read a partly updated x: that can
// change which expert is copied, never a result (a copy is used only when
// its expert is the one chosen, and the copy is complete before the join).
#pragma once
#include "backend/cuda/common.cuh"
#include "backend/cuda/tier_count.cuh"

namespace flashmoe::cuda {

// Blocks of copy_ahead_kernel: enough 16-byte loads in flight to fill the
// link (16 x 256 threads x 8 loads = 512 KB), few enough SMs taken from the
// mixer's kernels.
constexpr int kCopyAheadBlocks = 16;
constexpr int kCopyAheadLoads = 8;

// logits[e] = router row e . (x normed with the layer's post-attention norm
// nw), for e < E (the shared expert's gate row is not needed); a warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads) predict_logits_kernel(const T* __restrict__ R, int E, int H,
                                                                  const float* __restrict__ x,
                                                                  const float* __restrict__ nw, float eps,
                                                                  float* __restrict__ logits) {
  extern __shared__ __align__(16) float xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  load_x(x, nw, eps, H, xs);
  for (int e = blockIdx.x * kWarps + warp; e < E; e += gridDim.x * kWarps) {
    const float v = warp_sum(row_dot<T>(R + size_t(e) * H, xs, H, lane));
    if (lane == 0) logits[e] = v;
  }
}

struct CopyAheadArgs {
  const float* logits;  // [E] predicted
  int E;
  const int* tier;                // [E] 1: the expert is in pinned host memory
  const void* const* gu_tab;      // [E] the layer's tables
  const void* const* down_tab;
  size_t gu_bytes, dn_bytes;  // multiples of 16
  uint8_t *gu, *dn;           // the VRAM copy
  ExpertCopy* copy;
};

// The host-tier expert with the highest predicted logit (ties: the lower
// index) copied to a.gu / a.dn, and published in a.copy (src null: the
// layer has no host-tier expert). Every block makes the same choice.
static __global__ void __launch_bounds__(256) copy_ahead_kernel(CopyAheadArgs a) {
  __shared__ int pick;
  if (threadIdx.x < 32) {
    float best = -INFINITY;
    int be = 0x7fffffff;
    for (int e = int(threadIdx.x); e < a.E; e += 32)
      if (a.tier[e] == 1 && a.logits[e] > best) best = a.logits[e], be = e;
    warp_argmax(best, be);
    if (threadIdx.x == 0) pick = be == 0x7fffffff ? -1 : be;
  }
  __syncthreads();
  const int e = pick;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    a.copy->src_gu = e >= 0 ? a.gu_tab[e] : nullptr;
    a.copy->src_dn = e >= 0 ? a.down_tab[e] : nullptr;
    if (e >= 0) a.copy->copied += 1;  // this thread alone writes it, once per layer
  }
  if (e < 0) return;
  const uint4* s1 = static_cast<const uint4*>(a.gu_tab[e]);
  const uint4* s2 = static_cast<const uint4*>(a.down_tab[e]);
  uint4* d1 = reinterpret_cast<uint4*>(a.gu);
  uint4* d2 = reinterpret_cast<uint4*>(a.dn);
  const size_t n1 = a.gu_bytes / 16, n = n1 + a.dn_bytes / 16, stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i0 = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i0 < n; i0 += stride * kCopyAheadLoads) {
    uint4 v[kCopyAheadLoads];
#pragma unroll
    for (int u = 0; u < kCopyAheadLoads; ++u) {
      const size_t i = i0 + u * stride;
      if (i < n) v[u] = ld_stream(i < n1 ? s1 + i : s2 + (i - n1));
    }
#pragma unroll
    for (int u = 0; u < kCopyAheadLoads; ++u) {
      const size_t i = i0 + u * stride;
      if (i < n) (i < n1 ? d1[i] : d2[i - n1]) = v[u];
    }
  }
}

}  // namespace flashmoe::cuda
