// Copying a host-tier expert to VRAM during a MoE layer's mixer (tiered
// q4/q8 experts, DecodeOptions::copy_ahead_blocks).
//
// Why: with experts in pinned host memory the decode step is bound by the
// host link, and the link idles while each layer's mixer (projections,
// conv, delta rule or attention: HBM work) runs, because the experts a
// layer reads are known only after its router, which follows its mixer.
// The router's input is the layer's input residual plus the mixer's
// output, so the router applied to the input residual alone ranks the
// experts nearly as the real pick will. At the start of each MoE layer a
// second stream (forked from the step, joined back at the step's end, so it
// is part of the captured graph) computes those predicted logits
// (predict_logits_kernel) and copies the host-tier expert they rank highest
// into a VRAM buffer (copy_ahead_kernel), while the mixer runs on the main
// stream. The copy's last block sets the layer's flag to done; each block
// of gate_up, as it starts, sets a flag still busy to cancelled (the copy
// then stops: it would only compete with the expert reads for the link).
// A block that finds it done reads the chosen expert from the VRAM copy if
// it is the copied one (the same bytes: the results are bitwise unchanged,
// whichever copy a block reads); down reads it where the flag is done.
// Otherwise host memory is read as without the copy: a late or wrong copy
// costs link time the mixer left idle (and a few SMs), never a wait. The buffer is free again when
// the next layer's copy starts: that copy follows this layer's expert
// kernels (the fork) and this copy (the same stream). The flags are cleared
// at the step's end, after the join, so a flag is never one left from an
// earlier step. (DecodeOptions::copy_ahead_wait: the expert kernels wait
// for the copy instead, a join before them; the A/B of the two.)
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

// 16-byte loads in flight per thread of copy_ahead_kernel (256 threads per
// block, DecodeOptions::copy_ahead_blocks blocks).
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
  unsigned* ready;  // the layer's flag, set by the last block to finish (null: the expert kernels wait for the copy)
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
    if (a.ready && *static_cast<volatile unsigned*>(a.ready) == kCopyCancelled) break;  // gate_up started: too late
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
  if (!a.ready) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&a.copy->done_blocks, 1u) == gridDim.x - 1) {
      a.copy->done_blocks = 0;
      __threadfence();
      if (atomicCAS(a.ready, kCopyBusy, kCopyDone) == kCopyBusy) a.copy->in_time += 1;  // unless gate_up cancelled it
    }
  }
}

}  // namespace flashmoe::cuda
