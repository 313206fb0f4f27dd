// The Quest store on the GPU (--kv-resident N --kv-page P, KvLayer::quest):
// the CPU's KvCache semantics (src/kv/kv_cache.h, "quest N, P"). Every
// position is stored as `full` (device memory holds the whole store; what
// is bounded is what one query reads). Per page of P slots and KV head, the
// per-channel minimum and maximum of the keys as attention decodes them
// (fp8: code x scale; `rotated`: in the rotated basis). Each query, per KV
// head: U_j = sum_c max(q_c min_c, q_c max_c) over the candidate pages
// [1, recent0), the largest over the query heads that share the choice;
// page 0, the highest-U pages (ties: the newer) while whole pages fit in N,
// and the recent pages [recent0, newest]; attn_kernel then reads those
// positions only (quest_slot in attention.cuh).
//
// The bounds and U are summed in the CPU's order (channel by channel, one
// thread per page and query head), so the same keys and query give the
// same bits and the same ranking.
#pragma once
#include <cstdint>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/common.cuh"

namespace flashmoe::cuda {

// Key channel c of KV head kvh in slot s, decoded as attention reads it
// (the CPU's KvCache::row: fp8 is code x scale, rounded once).
__device__ __forceinline__ float quest_key(const KvLayer& L, int kvt, int nkv, int hd, int ns, int slot, int kvh,
                                           int c) {
  const size_t off = (size_t(slot) * nkv + kvh) * hd + c;
  switch (kvt) {
    case KV_F32: return kv_load<KV_F32>(L.k, off);
    case KV_BF16: return kv_load<KV_BF16>(L.k, off);
    case KV_F16: return kv_load<KV_F16>(L.k, off);
    default: return kv_load<KV_FP8>(L.k, off) * L.ks[size_t(slot) * ns + (ns == 1 ? 0 : kvh)];
  }
}

// The bounds of page j of KV head kvh over its slots below `end`,
// recomputed from the stored keys (so a page is right after any append,
// a roll-back or a restore); threads over the channels.
__device__ __forceinline__ void quest_page_bounds(const KvLayer& L, int kvt, int nkv, int hd, int ns, int kvh, int j,
                                                  int end) {
  const int s0 = j * L.qpage, s1 = min(end, s0 + L.qpage);
  for (int c = threadIdx.x; c < hd; c += blockDim.x) {
    float mn = INFINITY, mx = -INFINITY;
    for (int s = s0; s < s1; ++s) {
      const float k = quest_key(L, kvt, nkv, hd, ns, s, kvh, c);
      mn = fminf(mn, k);
      mx = fmaxf(mx, k);
    }
    const size_t o = (size_t(kvh) * hd + c) * L.qpcap + j;
    L.kmin[o] = mn;
    L.kmax[o] = mx;
  }
}

// The pages of slots [begin, end), every KV head: block = (page, KV head).
static __global__ void quest_bounds_kernel(KvLayer L, int kvt, int nkv, int hd, int ns, int begin, int end) {
  pdl_wait();
  pdl_trigger();
  const int pages = (end - 1) / L.qpage - begin / L.qpage + 1;
  const int j = begin / L.qpage + int(blockIdx.x) % pages, kvh = int(blockIdx.x) / pages;
  quest_page_bounds(L, kvt, nkv, hd, ns, kvh, j, end);
}
inline int quest_bounds_blocks(const KvLayer& L, int nkv, int begin, int end) {
  return ((end - 1) / L.qpage - begin / L.qpage + 1) * nkv;
}

// The pages recent0.. that every query past N reads, and how many middle
// pages fit beside them and page 0 (KvCache::quest_select_pages).
struct QuestPlan {
  int recent0, take, last;
};
__device__ __forceinline__ QuestPlan quest_plan(const KvLayer& L, int n) {
  const int P = L.qpage, recent0 = (n - max(1, L.qrecent)) / P;
  return {recent0, min(recent0 - 1, (L.quest - P - (n - recent0 * P)) / P), (n - 1) / P};
}

constexpr int kQuestTile = 32;  // candidate pages per block of quest_score_kernel (one per lane)
constexpr int kQuestWarps = 8;  // its warps: query heads of the group, 8 at a time

// U of the candidate pages for the query q (decode: one token, at *pos).
// Blocks (tile, KV head), tiles of 32 pages, a warp per query head of the
// group (the max over heads through shared memory); the last block of each
// KV head instead brings the bounds of the page of *pos up to date (that
// page is never a candidate of this query: recent0 <= its index).
// Shared memory: the group's query heads, G x hd floats.
static __global__ void __launch_bounds__(kQuestWarps * 32)
    quest_score_kernel(KvLayer L, const float* q, const int* pos, int kvt, int nh, int nkv, int hd, int ns) {
  extern __shared__ float qs[];
  __shared__ float red[kQuestWarps][kQuestTile];
  pdl_wait();
  pdl_trigger();
  const int tiles = (L.qpcap + kQuestTile - 1) / kQuestTile + 1;
  const int tile = int(blockIdx.x) % tiles, kvh = int(blockIdx.x) / tiles, n = *pos + 1;
  if (tile == tiles - 1) {
    quest_page_bounds(L, kvt, nkv, hd, ns, kvh, (n - 1) / L.qpage, n);
    return;
  }
  if (n <= L.quest) return;  // the whole context fits: no choice
  const QuestPlan pl = quest_plan(L, n);
  const int j0 = 1 + tile * kQuestTile;
  if (j0 >= pl.recent0) return;
  const int G = nh / nkv, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = j0 + lane;
  for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = q[size_t(kvh) * G * hd + i];
  __syncthreads();
  float best = -INFINITY;
  if (j < pl.recent0) {
    const float* mn = L.kmin + size_t(kvh) * hd * L.qpcap + j;
    const float* mx = L.kmax + size_t(kvh) * hd * L.qpcap + j;
    for (int g = warp; g < G; g += kQuestWarps) {
      const float* qg = qs + g * hd;
      float u = 0.f;  // the CPU's order: channel 0 first
      // kBatch channels' bounds loaded before any is used: 2 x kBatch loads
      // in flight per thread (one at a time, the 256 channels were a chain
      // of memory latencies whatever the page count: round 1, q1).
      constexpr int kBatch = 16;
      for (int c0 = 0; c0 < hd; c0 += kBatch) {
        float lo[kBatch], hi[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const size_t o = size_t(min(c0 + k, hd - 1)) * L.qpcap;
          lo[k] = mn[o];
          hi[k] = mx[o];
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (c0 + k < hd) {
            const float qc = qg[c0 + k];
            u += fmaxf(qc * lo[k], qc * hi[k]);
          }
      }
      best = fmaxf(best, u);
    }
  }
  red[warp][lane] = best;
  __syncthreads();
  if (warp == 0 && j < pl.recent0) {
    for (int w = 1; w < kQuestWarps; ++w) best = fmaxf(best, red[w][lane]);
    L.qub[size_t(kvh) * L.qpcap + j] = best;
  }
}
inline int quest_score_blocks(const KvLayer& L, int nkv) {
  return ((L.qpcap + kQuestTile - 1) / kQuestTile + 1) * nkv;
}

// Orders (U, page) as the CPU ranks them: higher U first, ties the newer
// page: a float's bits made monotonic, the page index below them.
__device__ __forceinline__ uint64_t quest_key_of(const KvLayer& L, int nkv, int kvh, int j) {
  float u = L.qub[size_t(kvh) * L.qpcap + j];
  if (L.qlayer)  // one choice for the layer: the largest over all query heads
    for (int k = 0; k < nkv; ++k) u = fmaxf(u, L.qub[size_t(k) * L.qpcap + j]);
  uint32_t b = __float_as_uint(u);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t(b) << 32) | uint32_t(j);
}

constexpr int kQuestSelectThreads = 1024;

// The chosen pages of each KV head (block kvh), ascending, and the
// positions they hold. The `take` largest keys of the candidates are those
// >= the take-th largest, found bit by bit from the top (each round counts
// the keys at or above a trial value: __syncthreads_count); keys are
// distinct (the page is in them), so exactly `take` pass.
// row_bytes: one KV head's K (or V) row of a slot.
static __global__ void __launch_bounds__(kQuestSelectThreads)
    quest_select_kernel(KvLayer L, const int* pos, int nkv, int row_bytes) {
  __shared__ int warp_n[kQuestSelectThreads / 32];
  pdl_wait();
  pdl_trigger();
  const int kvh = blockIdx.x, n = *pos + 1, P = L.qpage;
  int* out = L.qsel + size_t(kvh) * L.qmaxp;
  if (n <= L.quest) {  // every page
    for (int j = threadIdx.x; j <= (n - 1) / P; j += blockDim.x) out[j] = j;
    if (threadIdx.x == 0) L.qn[kvh] = n;
    return;
  }
  const QuestPlan pl = quest_plan(L, n);
  const int cand = pl.recent0 - 1, take = max(pl.take, 0);  // candidates: pages 1 .. recent0 - 1
  // The first candidate of each thread in a register (one pass when
  // there are at most blockDim of them); the others re-read.
  const uint64_t held = int(threadIdx.x) < cand ? quest_key_of(L, nkv, kvh, 1 + threadIdx.x) : 0;
  auto key = [&](int r, int i) { return r == 0 ? held : quest_key_of(L, nkv, kvh, 1 + i); };
  uint64_t t = 0;
  if (take > 0) {
    const int low = 32 - __clz(pl.recent0);  // bits of a page index
    for (int bit = 63; bit >= 0; --bit) {
      if (bit < 32 && bit >= low) continue;  // always 0 in every key
      const uint64_t trial = t | (uint64_t(1) << bit);
      int at_or_above = 0;
      for (int r = 0; r * int(blockDim.x) < cand; ++r) {
        const int i = threadIdx.x + r * blockDim.x;
        at_or_above += __syncthreads_count(i < cand && key(r, i) >= trial);
      }
      if (at_or_above >= take) t = trial;
    }
  }
  // Page 0, the chosen candidates in order (a block-wide prefix count),
  // then the recent pages.
  if (threadIdx.x == 0) out[0] = 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int base = 1;
  for (int r = 0; take > 0 && r * int(blockDim.x) < cand; ++r) {
    const int i = threadIdx.x + r * blockDim.x;
    const bool chosen = i < cand && key(r, i) >= t;
    const unsigned m = __ballot_sync(0xffffffffu, chosen);
    if (lane == 0) warp_n[warp] = __popc(m);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < int(blockDim.x) / 32; ++w) {
      if (w < warp) before += warp_n[w];
      total += warp_n[w];
    }
    if (chosen) out[base + before + __popc(m & ((1u << lane) - 1u))] = 1 + i;
    base += total;
    __syncthreads();  // warp_n is rewritten next round
  }
  for (int j = pl.recent0 + int(threadIdx.x); j <= pl.last; j += blockDim.x) out[1 + take + (j - pl.recent0)] = j;
  const int chosen = P * (1 + take + (pl.last - pl.recent0)) + (n - pl.last * P);
  if (threadIdx.x == 0) L.qn[kvh] = chosen;
  // The chosen K and V rows into L2 now, all at once (attn_kernel cannot
  // prefetch them before its wait, as it does for the other policies:
  // until here nobody knew them).
  __syncthreads();  // out[] complete
  const int lines = (row_bytes + 127) / 128;
  for (int t2 = threadIdx.x; t2 < chosen * lines; t2 += blockDim.x) {
    const int i = t2 / lines;
    const size_t off = (size_t(quest_slot(L, kvh, i)) * nkv + kvh) * row_bytes + size_t(t2 % lines) * 128;
    prefetch_l2(static_cast<const char*>(L.k) + off);
    prefetch_l2(static_cast<const char*>(L.v) + off);
  }
}

}  // namespace flashmoe::cuda
