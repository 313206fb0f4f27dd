// Host-tier experts by the copy engine (tiered q4/q8 experts without the
// disk tier: on by the rule in init_common, upload.cu).
//
// Why: with experts in pinned host memory the decode step is bound by the
// host link. Read by the expert kernels straight from host memory
// (zero-copy) the bytes cross it at ~51 GB/s; cudaMemcpyAsync (the copy
// engine) moves them at ~55. And the link idles while each layer's mixer
// (projections, conv, delta rule or attention: HBM work) runs, because the
// experts a layer reads are known only after its router, which follows the
// mixer. So every chosen host-tier expert is copied into a VRAM staging
// area by the copy engine on a stream of its own (no SMs taken), and a few
// are copied ahead, before the router, from a prediction:
//
// - Copies ahead: a router applied to a residual the layer's real router
//   input is close to ranks the experts nearly as the real pick will.
//   predict_pick_kernel computes those logits and writes the n host-tier
//   experts they rank highest to pinned host memory. For the step's first
//   MoE layer it runs at the layer's start on its input (the mixer is
//   enqueued behind it; the host waits for the pick and issues the copies,
//   which run during the mixer). With prefetch_next the later layers' picks
//   run at the previous MoE layer's router instead (that layer's residual
//   before its experts, the next layer's router and norm), and their copies
//   are issued right behind the previous layer's own, so the copy engine's
//   queue does not empty between two layers; they go to the staging slots
//   of the other parity (MoE layer index % 2).
// - After the router: stage_sel_kernel points each chosen expert that was
//   copied ahead at its staged copy, gives every other chosen host-tier
//   expert a staging slot of its own (kPrefetchMax + its routed slot) and
//   lists those in pinned memory (PrefetchRest); the host, which has
//   already enqueued the layer's expert kernels, waits for it and copies
//   them behind the copies ahead.
//
// After each expert's copy the copy stream writes that staging slot's flag
// (cuStreamWriteValue32, or a 4-byte copy) with the layer's sequence
// number; the expert kernels' blocks of a slot that reads a staged copy
// poll its flag (MoeArgs::pf_slot) and read the copy: the same bytes, so
// the results are bitwise those of the zero-copy kernels; the VRAM experts
// and the shared expert run meanwhile. The host waits for the device twice
// per MoE layer, which is why such a step runs as plain launches, not a
// CUDA graph.
//
// A staging slot is rewritten only after its last reader: the copies after
// a layer's router are issued when its stage_sel_kernel completed, which
// follows the previous layer's expert kernels on the step's stream; the
// copies ahead into a parity's slots are issued after the router of the
// layer between, or (first MoE layer) after the pick, which runs without
// PDL after the previous expert kernels. A copy's source is a host slot
// whose table entry pointed there when the pick or the router ran;
// promotions write a host slot only after the steps enqueued before its
// table entry moved away are done (expert_tiers.cuh), and those steps
// wait for their copies.
#pragma once
#include "backend/cuda/common.cuh"

namespace flashmoe::cuda {

// Staging slots of the copies ahead (two parities of kPrefetchMax / 2: at
// most that many copies ahead per layer).
constexpr int kPrefetchMax = 8;
// Then one staging slot per routed slot (at most kRestMax) for the chosen
// host-tier experts copied after the router.
constexpr int kRestMax = 32;
constexpr int kStageSlots = kPrefetchMax + kRestMax;
// Flag values in pinned memory for the 4-byte copies that write the flags
// where the driver has no cuStreamWriteValue32 (a ring indexed by sequence number).
constexpr int kSeqRing = 1024;

// What stage_sel_kernel leaves for the host (pinned, device-mapped memory)
// after the router: per routed slot j, the sources of a chosen host-tier
// expert that was not copied ahead (null: none to copy). The host copies it
// into staging slot kPrefetchMax + j.
struct PrefetchRest {
  const void* gu[kRestMax];
  const void* dn[kRestMax];
  // Set by an expert kernel that waited kCopyWaitLimitNs for a copy
  // (wait_copied_thread): the host fails the step instead of hanging.
  unsigned stuck;
};

// How long an expert kernel waits for a copy before it gives up and says
// so: copies take well under a millisecond, so only a copy that was never
// issued waits this long.
constexpr unsigned long long kCopyWaitLimitNs = 20000000000ull;

// What the pick leaves for the host (pinned, device-mapped memory): the
// sources of the n copies (null: fewer host-tier experts than n).
struct PrefetchPick {
  const void* gu[kPrefetchMax];
  const void* dn[kPrefetchMax];
  int expert[kPrefetchMax];
};

struct PredictArgs {
  int E, H, n;
  const float* x;   // the layer's input residual
  const float* nw;  // the post-attention norm's weights
  float eps;
  float* logits;                  // [E] scratch
  unsigned* done;                 // block counter, 0 between launches
  const int* tier;                // [E] 1: in pinned host memory
  const void* const* gu_tab;      // [E] the layer's tables
  const void* const* down_tab;
  const void** src;        // [2 n] device copy of the picks' sources (gu, then down) for stage_sel_kernel
  PrefetchPick* pick;      // pinned host memory
  int lowest;              // tests: the n lowest-ranked host-tier experts (wrong predictions)
};

// logits[e] = router row e . (x normed with the layer's post-attention norm),
// a warp per row; the last block to finish picks the n host-tier experts of
// highest predicted logit (ties: the lower index; `lowest`: the lowest).
template <typename T>
__global__ void __launch_bounds__(kThreads) predict_pick_kernel(const T* __restrict__ R, PredictArgs a) {
  extern __shared__ __align__(16) float xs[];
  __shared__ bool last;
  __shared__ int picked[kPrefetchMax];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  load_x(a.x, a.nw, a.eps, a.H, xs);
  for (int e = blockIdx.x * kWarps + warp; e < a.E; e += gridDim.x * kWarps) {
    const float v = warp_sum(row_dot<T>(R + size_t(e) * a.H, xs, a.H, lane));
    if (lane == 0) a.logits[e] = v;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last || warp != 0) return;
  __threadfence();
  for (int p = 0; p < a.n; ++p) {
    float best = -INFINITY;
    int be = 0x7fffffff;
    for (int e = lane; e < a.E; e += 32) {
      if (a.tier[e] != 1) continue;
      bool taken = false;
      for (int q = 0; q < p; ++q) taken |= picked[q] == e;
      const float v = __ldcg(a.logits + e);
      const float s = a.lowest ? -v : v;
      if (!taken && (s > best || be == 0x7fffffff)) best = s, be = e;
    }
    warp_argmax(best, be);
    const int e = be == 0x7fffffff ? -1 : be;
    if (lane == 0) {
      picked[p] = e;
      const void* g = e >= 0 ? a.gu_tab[e] : nullptr;
      const void* d = e >= 0 ? a.down_tab[e] : nullptr;
      a.src[p] = g;
      a.src[a.n + p] = d;
      a.pick->gu[p] = g;
      a.pick->dn[p] = d;
      a.pick->expert[p] = e;
    }
    __syncwarp();
  }
  if (lane == 0) {
    *a.done = 0;
    __threadfence_system();
  }
}

// Each chosen expert (sel[j], sel[k + j]) that is one of the n copied ahead
// reads its staged copy (staging slot pbase + p); used counts them. Every
// other chosen expert in host memory (tier[ids[j]] == 1) is to be copied by
// the host after this kernel into staging slot kPrefetchMax + j, which it
// then reads; its sources go to rest (null where nothing is to copy). slot
// gets each routed slot's staging slot, -1 where it reads none. One warp.
static __global__ void stage_sel_kernel(const void** sel, int k, const void* const* src, int n, int pbase,
                                        uint8_t* stage, size_t gu_bytes, size_t dn_bytes, unsigned long long* used,
                                        int* slot, const int* ids, const int* tier, PrefetchRest* rest) {
  pdl_wait();
  pdl_trigger();
  const int j = threadIdx.x;
  if (j >= k) return;
  const void* g = sel[j];
  int hit = -1;
  for (int p = 0; p < n; ++p)
    if (src[p] && g == src[p]) {
      hit = pbase + p;
      atomicAdd(used, 1ull);
      break;
    }
  const void* rg = nullptr;
  const void* rd = nullptr;
  if (hit < 0 && tier[ids[j]] == 1) {
    hit = kPrefetchMax + j;
    rg = g;
    rd = sel[k + j];
  }
  if (hit >= 0) {
    uint8_t* s = stage + size_t(hit) * (gu_bytes + dn_bytes);
    sel[j] = s;
    sel[k + j] = s + gu_bytes;
  }
  slot[j] = hit;
  rest->gu[j] = rg;
  rest->dn[j] = rd;
  __threadfence_system();
}

}  // namespace flashmoe::cuda
