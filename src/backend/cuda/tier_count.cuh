// What the router's top-k records for the tiered expert cache (shared by the
// kernels and ExpertTiers, which owns the arrays).
#pragma once

namespace flashmoe::cuda {

// Per-layer expert accounting of the tiered expert cache (null when off).
struct TierCount {
  unsigned* counts;          // [E] times each expert was chosen
  const int* tier;           // [E] where it is read from: 0 VRAM, 1 pinned host memory
  unsigned long long* hits;  // [2] choices served per tier (all layers)
};

// The host-tier expert the decode step copied to VRAM ahead of a MoE
// layer's expert kernels (expert_prefetch.cuh), in device memory: the
// expert kernels read a chosen expert whose host rows are src_gu / src_dn
// from gu / dn instead (the same bytes, so the same results).
struct ExpertCopy {
  const void* src_gu;  // the copied expert's table entries (host rows), or null: none copied this layer
  const void* src_dn;
  const void* gu;  // its copy in VRAM
  const void* dn;
  unsigned long long copied, used;  // experts copied, and copies the expert kernels read (all layers)
  unsigned long long in_time;       // copies complete before their layer's gate_up started (no-wait mode)
  unsigned done_blocks;             // copy_ahead_kernel's blocks finished (the last one publishes the copy)
};

// A layer's copy-ahead flag: cleared at the step's end; the copy's last
// block sets kCopyDone unless gate_up, starting first, set kCopyCancelled
// (then the copy stops and host memory is read as without it).
constexpr unsigned kCopyBusy = 0, kCopyDone = 1, kCopyCancelled = 2;

// A flag another stream's kernel published (a copy ahead complete,
// expert_prefetch.cuh): the reads after it see what was written before.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace flashmoe::cuda
