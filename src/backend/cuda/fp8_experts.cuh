// The routed experts' products for FP8 block experts (Qwen's / DeepSeek's
// FP8 releases: one E4M3 code per weight, one fp32 scale per block of
// block_rows x group weights; device blocks as QExpert with fp8 set,
// device_model.cuh). The codes are read as stored, 16 per 16-byte load,
// widened in registers (Hopper's cvt.rn.f16x2.e4m3x2: exact, E4M3 fits in
// f16), multiplied against fp32 x; a chunk's 16 columns lie in one scale
// block (group is a multiple of 16), so its dot is scaled once. The same
// structure as quant_experts.cuh (x staged chunk-major, kF8Loads chunks in
// flight per lane); the shared expert (slot k) keeps its storage type TS,
// or is FP8 too (TS = F8Rows: a DMat's per-row scales, fp8_matvec.cuh).
// Blocks a multiple of 64 columns wide (the releases' 128) take the tensor
// core kernels at the end of this file (fp8_mma.cuh); the FFMA kernels
// here serve the other block widths.
#pragma once
#include "backend/cuda/fp8_matvec.cuh"
#include "backend/cuda/quant_experts.cuh"

namespace flashmoe::cuda {

// The shared expert's row r (cols wide) dotted with xs: in storage type TS,
// or FP8 with per-row scales (sc, group).
template <typename TS>
__device__ __forceinline__ float shared_row_dot(const void* W, const float* sc, int group, int r, const float* xs,
                                                int cols, int lane) {
  if constexpr (std::is_same_v<TS, F8Rows>) {
    const int nbc = (cols + group - 1) / group;
    return fp8_row_dot(static_cast<const uint8_t*>(W) + size_t(r) * cols, sc + size_t(r) * nbc, group, 0, xs, cols,
                       lane);
  } else {
    return row_dot<TS>(static_cast<const TS*>(W) + size_t(r) * cols, xs, cols, lane);
  }
}

// The unscaled dot of 16 codes (one 16-byte chunk) with x staged
// chunk-major (stage_chunks<8>: float4 i of the chunk at xq[i * stride]).
__device__ __forceinline__ float fp8_chunk_dot(const uint4& v, const float4* xq, int stride) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  float d = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = xq[i * stride];
    const float2 a = e4m3x2_to_float2(u[i]), b = e4m3x2_to_float2(u[i] >> 16);
    d = fmaf(a.x, x.x, d);
    d = fmaf(a.y, x.y, d);
    d = fmaf(b.x, x.z, d);
    d = fmaf(b.y, x.w, d);
  }
  return d;
}

// Row r of an FP8 block matrix inside an expert block B: its codes (cols
// bytes) and its block row's scales.
struct F8Row {
  const uint8_t* w;
  const float* s;
};
__device__ __forceinline__ F8Row f8row(const uint8_t* B, size_t w, size_t s, int cols, int nbc, int block_rows,
                                       int r) {
  return {B + w + size_t(r) * cols, reinterpret_cast<const float*>(B + s) + size_t(r / block_rows) * nbc};
}
// 16-byte chunks of codes each lane has in flight at once, as the q8
// kernels' kQLoads (8 measured slower on the 35B: bench/NOTES-cuda.md, FP8).
constexpr int kF8Loads = 4;
struct F8Loads {
  uint4 v[kF8Loads];
  float s[kF8Loads];
};

// One lane's chunk t in flight: codes and the chunk's block scale.
__device__ __forceinline__ void f8load(F8Loads& L, int t, const F8Row& R, int ch, int group) {
  L.v[t] = ld_stream(R.w + ch * 16);
  L.s[t] = __ldg(R.s + ch * 16 / group);
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j (as
// gate_up_q_kernel, including the fold's early pick: block (0,0) then
// computes the routing weights). With logits and no early pick, each routed
// block picks the experts itself from the router's logits (as
// gate_up_kernel: no top-k kernel between router and experts); block (0,0)
// publishes ids, weights and row pointers for down and does the counting.
template <typename TS>
__global__ void __launch_bounds__(kThreads) gate_up_fp8_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) float xs[];  // [H] x normed, [H] chunk-major, [H / 8] sums
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool pick = !shared && a.logits && !a.presel;  // uniform over the block
  if (pick && warp == 0) prefetch_tables(a.tsel, a.E);
  pdl_wait();
  pdl_trigger();
  const uint8_t* B =
      shared || pick ? nullptr : static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
  const int cpr = a.H / 16, nbc = (a.H + q.group - 1) / q.group;
  auto row = [&](int part, int r) {
    return part ? f8row(B, q.up_w, q.up_s, a.H, nbc, q.block_rows, r) : f8row(B, 0, q.gate_s, a.H, nbc, q.block_rows, r);
  };
  auto issue = [&](F8Loads& L, int r, int i0) {
#pragma unroll
    for (int t = 0; t < kF8Loads; ++t) {
      const int idx = i0 + 32 * t, part = idx >= cpr;
      if (idx < 2 * cpr) f8load(L, t, row(part, r), idx - part * cpr, q.group);
    }
  };
  F8Loads L;
  const int r_first = blockIdx.x * kWarps + warp;
  const bool early = !shared && !pick && r_first < I;
  if (early) issue(L, r_first, lane);  // in flight while x is normed and staged
  const float rx = load_x(a.x, a.norm_w, a.eps, a.H, xs);
  float4* xq = reinterpret_cast<float4*>(xs + a.H);
  float* s8 = xs + 2 * a.H;
  stage_chunks<8>(xs, a.H, xq, s8);
  __syncthreads();
  if (a.presel && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
    topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rx : 1.0f, a.w_out);
  if (pick) B = static_cast<const uint8_t*>(pick_block_expert(a, j, a.folded ? rx : 1.0f));
  for (int r = r_first; r < I; r += gridDim.x * kWarps) {
    float g = 0.f, u = 0.f;
    if (shared) {
      g = shared_row_dot<TS>(a.s_gu, a.s_gu_sc, a.s_group, r, xs, a.H, lane);
      u = shared_row_dot<TS>(a.s_gu, a.s_gu_sc, a.s_group, I + r, xs, a.H, lane);
    } else {
      for (int i0 = lane; i0 < 2 * cpr; i0 += 32 * kF8Loads) {
        if (!early || r != r_first || i0 != lane) issue(L, r, i0);
#pragma unroll
        for (int t = 0; t < kF8Loads; ++t) {
          const int idx = i0 + 32 * t, part = idx >= cpr, ch = idx - part * cpr;
          if (idx < 2 * cpr) {
            const float d = L.s[t] * fp8_chunk_dot(L.v[t], xq + ch, cpr);
            if (part) u += d;
            else g += d;
          }
        }
      }
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) a.hb[j * a.maxI + r] = siluf_(g) * u;
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j, one warp per row (as down_q_kernel):
// the routed slots' h staged chunk-major, their chunks of the row spread
// over the lanes, then the shared expert's row.
template <typename TS>
__global__ void __launch_bounds__(kThreads) down_fp8_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) float4 hq[];  // [k][I / 4] each routed slot's h chunk-major, then [k][I / 8] sums
  __shared__ const uint8_t* ptr[32];
  __shared__ float wj[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k = a.k;
  pdl_wait();
  pdl_trigger();
  if (int(threadIdx.x) < k) ptr[threadIdx.x] = static_cast<const uint8_t*>(
      a.sel ? a.sel[k + threadIdx.x] : a.down_tab[a.ids[threadIdx.x]]);
  if (int(threadIdx.x) < k + (a.has_shared ? 1 : 0)) wj[threadIdx.x] = a.w[threadIdx.x];
  __syncthreads();
  const int cpr = a.I / 16, n = k * cpr, nbc = (a.I + q.group - 1) / q.group;
  auto issue = [&](F8Loads& L, int r, int i0) {
#pragma unroll
    for (int t = 0; t < kF8Loads; ++t) {
      const int idx = i0 + 32 * t, sl = idx / cpr;
      if (idx < n) f8load(L, t, f8row(ptr[sl], 0, q.dn_s, a.I, nbc, q.block_rows, r), idx - sl * cpr, q.group);
    }
  };
  F8Loads L;
  const int r_first = blockIdx.x * kWarps + warp;
  if (r_first < a.H) issue(L, r_first, lane);  // in flight while h is staged
  float* s8 = reinterpret_cast<float*>(hq + k * (a.I / 4));
  for (int j = 0; j < k; ++j) stage_chunks<8>(a.hb + j * a.maxI, a.I, hq + j * (a.I / 4), s8 + j * (a.I / 8));
  __syncthreads();
  for (int r = r_first; r < a.H; r += gridDim.x * kWarps) {
    float acc = 0.f;
    for (int i0 = lane; i0 < n; i0 += 32 * kF8Loads) {
      if (r != r_first || i0 != lane) issue(L, r, i0);
#pragma unroll
      for (int t = 0; t < kF8Loads; ++t) {
        const int idx = i0 + 32 * t, sl = idx / cpr, ch = idx - sl * cpr;
        if (idx < n) acc += wj[sl] * (L.s[t] * fp8_chunk_dot(L.v[t], hq + sl * (a.I / 4) + ch, cpr));
      }
    }
    if (a.has_shared)
      acc += wj[k] * shared_row_dot<TS>(a.s_down, a.s_down_sc, a.s_group, r, a.hb + k * a.maxI, a.Is, lane);
    acc = warp_sum(acc);
    if (lane == 0) a.x[r] += acc;
  }
}

// ------------------------------------------------ tensor cores (fp8_mma.cuh)
// For blocks a multiple of 64 columns wide (routed experts' q.group, and
// an FP8 shared expert's s_group).

constexpr int kGuSplit = 4;  // gate_up: warps per tile (each a quarter of the columns)

// Whether gate_up_fp8_mma_kernel keeps an fp32 copy of the normed x in
// shared memory: where a block cannot norm and split x in one pass (no
// norm, or x too wide for NormPre) or reads it with row_dot (a float shared
// expert's blocks).
__host__ __device__ inline bool f8_gate_up_xf(const MoeArgs& a, bool f8s) {
  return !(a.norm_w && a.H <= kNormPer * kThreads) || (a.has_shared && !f8s);
}
// Its dynamic shared memory: x normed (fp32, where f8_gate_up_xf), x split
// for the mma, then the warps' slots (fp8_staged.cuh).
inline size_t f8_mma_gate_up_smem(int H, bool xf) {
  return (xf ? size_t(H) * 4 : 0) + (f8_split_bytes(H) + 15) / 16 * 16 + f8_warp_bufs(kWarps);
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j (as
// gate_up_fp8_kernel, the same pick and presel duties of block (0,0)). A
// tile is 8 rows of gate (mma rows 0-7) and the same 8 rows of up (8-15),
// so a lane with t = 0 ends with both sums of one h row; kGuSplit warps
// share a tile's columns. The shared expert in FP8 (TS = F8Rows) is
// tiled the same way; in a float type it keeps row_dot, a warp per row.
template <typename TS>
__global__ void __launch_bounds__(kThreads, 3) gate_up_fp8_mma_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) float xs[];  // f8_mma_gate_up_smem: [H] x normed (xf), its split, the slots
  __shared__ float part[kWarps][16];
  constexpr bool f8s = std::is_same_v<TS, F8Rows>;
  const bool xf = f8_gate_up_xf(a, f8s);
  __half* sp = reinterpret_cast<__half*>(xs + (xf ? a.H : 0));
  uint4* buf = f8_warp_buf(reinterpret_cast<char*>(sp) + (f8_split_bytes(a.H) + 15) / 16 * 16);
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  const int tpb = kWarps / kGuSplit, ngroups = (I + 7) / 8;
  if (shared && !f8s ? int(blockIdx.x) * kWarps >= I : int(blockIdx.x) * tpb >= ngroups) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int sub = warp % kGuSplit, lt = warp / kGuSplit;
  const int slice = f8_padded((a.H + kGuSplit - 1) / kGuSplit), k0 = min(a.H, sub * slice),
            k1 = min(a.H, k0 + slice);
  const bool pick = !shared && a.logits && !a.presel;  // uniform over the block
  const int group = shared ? (f8s ? a.s_group : kF8Step) : q.group, nbc = (a.H + group - 1) / group;
  const uint8_t* B = nullptr;
  // Tile rg's rows: gate row rg * 8 + g and up row rg * 8 + g.
  auto tile_rows = [&](int rg) {
    const int r = rg * 8 + g;
    F8TileRows R{nullptr, nullptr, nullptr, nullptr};
    if (r >= I) return R;
    if (shared) {
      const uint8_t* W = static_cast<const uint8_t*>(a.s_gu);
      R.w0 = W + size_t(r) * a.H;
      R.w1 = W + size_t(I + r) * a.H;
      R.s0 = a.s_gu_sc + size_t(r) * nbc;
      R.s1 = a.s_gu_sc + size_t(I + r) * nbc;
    } else {
      R.w0 = B + size_t(r) * a.H;
      R.w1 = B + q.up_w + size_t(r) * a.H;
      R.s0 = reinterpret_cast<const float*>(B + q.gate_s) + size_t(r / q.block_rows) * nbc;
      R.s1 = reinterpret_cast<const float*>(B + q.up_s) + size_t(r / q.block_rows) * nbc;
    }
    return R;
  };
  // The warp's first tile's codes, in flight while x is normed and split:
  // an FP8 shared expert's before the wait, a routed one's once its
  // pointer is known (not where this block picks the experts itself).
  F8Batch first;
  const int rg_first = blockIdx.x * tpb + lt;
  const bool have_first = (shared ? f8s : !pick) && rg_first < ngroups && k0 < k1;
  if (f8s && shared) {  // known before the wait
    if (have_first) F8Staged::first(tile_rows(rg_first), k0, k1, group, lane, first, buf);
  }
  if (pick && warp == 0) prefetch_tables(a.tsel, a.E);
  NormPre pre;
  norm_preload(a.norm_w, a.H, true, pre);
  pdl_wait();
  pdl_trigger();
  if (!shared && !pick) {
    B = static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
    if (have_first) F8Staged::first(tile_rows(rg_first), k0, k1, group, lane, first, buf);
  }
  // x normed and split in one pass where no float copy is needed (only a
  // float shared expert reads xs).
  float rx;
  F8Split X;
  if (a.norm_w && pre.on && (f8s || !shared)) {
    X = f8_norm_split_block(a.x, a.eps, a.H, pre, sp, &rx);
  } else {
    rx = load_x(a.x, a.norm_w, a.eps, a.H, xs, &pre);
    X = f8_split_block(xs, a.H, sp);
  }
  if (a.presel && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
    topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rx : 1.0f, a.w_out);
  if (pick) B = static_cast<const uint8_t*>(pick_block_expert(a, j, a.folded ? rx : 1.0f));
  if constexpr (!f8s) {
    if (shared) {
      for (int r = blockIdx.x * kWarps + warp; r < I; r += gridDim.x * kWarps) {
        const float gs = warp_sum(row_dot<TS>(static_cast<const TS*>(a.s_gu) + size_t(r) * a.H, xs, a.H, lane));
        const float us = warp_sum(row_dot<TS>(static_cast<const TS*>(a.s_gu) + size_t(I + r) * a.H, xs, a.H, lane));
        if (lane == 0) a.hb[j * a.maxI + r] = siluf_(gs) * us;
      }
      return;
    }
  }
  for (int rg0 = blockIdx.x * tpb; rg0 < ngroups; rg0 += gridDim.x * tpb) {
    const int rg = rg0 + lt;
    float d0 = 0.f, d1 = 0.f;
    if (rg < ngroups && k0 < k1) {
      const F8TileRows R = tile_rows(rg);
      F8Batch F = first;
      if (!(have_first && rg == rg_first)) F8Staged::first(R, k0, k1, group, lane, F, buf);
      F8Staged::dot(R, X, k0, k1, group, lane, F, buf, d0, d1);
    }
    if ((lane & 3) == 0) part[warp][g] = d0, part[warp][g + 8] = d1;
    __syncthreads();
    if (int(threadIdx.x) < tpb * 8) {
      const int l2 = threadIdx.x / 8, i = threadIdx.x % 8, r = (rg0 + l2) * 8 + i;
      if (r < I) {
        float gs = 0.f, us = 0.f;
        for (int k = 0; k < kGuSplit; ++k) gs += part[l2 * kGuSplit + k][i], us += part[l2 * kGuSplit + k][8 + i];
        a.hb[j * a.maxI + r] = siluf_(gs * X.inv) * (us * X.inv);
      }
    }
    __syncthreads();
  }
}

constexpr int kDnWarps = 16;  // down: most warps per block (one 16-row tile per block)

constexpr int kDnPiece = F8Staged::kPiece;  // down: columns of one slot a warp takes (one batch)

// down's warps per block: one per piece of kDnPiece columns of the slots,
// at most kDnWarps; kDnWarps with a float shared expert (its 16 rows take
// a warp each). f8s: the shared expert, where there is one, is FP8.
inline int f8_down_warps(const MoeArgs& a, bool f8s) {
  if (a.has_shared && !f8s) return kDnWarps;
  const bool fs = a.has_shared && f8s;
  const int widest = std::max(a.I, fs ? a.Is : 0);
  return std::min(kDnWarps, (a.k + (fs ? 1 : 0)) * ((widest + kDnPiece - 1) / kDnPiece));
}
// Its dynamic shared memory: each slot's h split for the mma (the routed
// slots', and an FP8 shared expert's), then the slots of `warps` warps.
inline size_t f8_mma_down_smem(int k, int I, int Is, bool f8_shared, int warps) {
  const size_t h = size_t(k + (f8_shared ? 1 : 0)) * f8_split_bytes(std::max(I, f8_shared ? Is : 0));
  return (h + 15) / 16 * 16 + f8_warp_bufs(warps);
}

// x[r] += sum_j w_j * down_j[r] . h_j (as down_fp8_kernel): a block takes
// 16 rows of x; each slot's h is split for the mma (a warp per slot), the
// slots' columns go out in pieces of kDnPiece to the block's warps
// (f8_down_warps), whose sums (each weighted by its slot's w) are added in
// a fixed order. The shared expert is one more slot in FP8 (TS = F8Rows),
// else row_dot by a warp per row (16 warps).
template <typename TS>
__global__ void __launch_bounds__(kDnWarps * 32, 1) down_fp8_mma_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) uint8_t hs[];  // f8_mma_down_smem: [slots] h split (of the widest), the slots
  __shared__ const uint8_t* ptr[32];
  __shared__ float wj[33], inv[33], extra[16];
  __shared__ float part[kDnWarps][16];
  constexpr bool f8s = std::is_same_v<TS, F8Rows>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, k = a.k;
  const int nw = int(blockDim.x) >> 5;
  const int ns = k + (f8s && a.has_shared ? 1 : 0);
  const int widest = max(a.I, ns > k ? a.Is : 0), npiece = (widest + kDnPiece - 1) / kDnPiece;
  const size_t sb = f8_split_bytes(widest);
  uint4* buf = f8_warp_buf(hs + (size_t(ns) * sb + 15) / 16 * 16);
  // Where the pick was final before gate_up (MoeArgs::sel_ready), the
  // experts' rows are known before the wait: the warp's first codes are on
  // their way while gate_up ends.
  const bool early = a.sel_ready && a.sel;
  auto set_ptr = [&] {
    if (int(threadIdx.x) < k) ptr[threadIdx.x] = static_cast<const uint8_t*>(
        a.sel ? a.sel[k + threadIdx.x] : a.down_tab[a.ids[threadIdx.x]]);
  };
  const int nbcI = (a.I + q.group - 1) / q.group, nbcS = ns > k ? (a.Is + a.s_group - 1) / a.s_group : 0;
  // Slot s's rows g and g + 8 of a tile.
  auto unit_rows = [&](int s, int tile) {
    const int r0 = tile * 16 + g, r1 = r0 + 8;
    F8TileRows R{nullptr, nullptr, nullptr, nullptr};
    if (s < k) {
      const uint8_t* D = ptr[s];
      const float* sc = reinterpret_cast<const float*>(D + q.dn_s);
      if (r0 < a.H) R.w0 = D + size_t(r0) * a.I, R.s0 = sc + size_t(r0 / q.block_rows) * nbcI;
      if (r1 < a.H) R.w1 = D + size_t(r1) * a.I, R.s1 = sc + size_t(r1 / q.block_rows) * nbcI;
    } else {
      const uint8_t* D = static_cast<const uint8_t*>(a.s_down);
      if (r0 < a.H) R.w0 = D + size_t(r0) * a.Is, R.s0 = a.s_down_sc + size_t(r0) * nbcS;
      if (r1 < a.H) R.w1 = D + size_t(r1) * a.Is, R.s1 = a.s_down_sc + size_t(r1) * nbcS;
    }
    return R;
  };
  // The warp's first unit's codes on their way while h is split (or, early,
  // while gate_up ends).
  F8Batch first;
  bool have_first = false;
  auto issue_first = [&] {
    set_ptr();
    __syncthreads();
    if (warp < ns * npiece && int(blockIdx.x) * 16 < a.H) {
      const int s = warp / npiece, len = s < k ? a.I : a.Is, c0 = (warp % npiece) * kDnPiece;
      have_first = c0 < len;
      if (have_first)
        F8Staged::first(unit_rows(s, blockIdx.x), c0, min(len, c0 + kDnPiece), s < k ? q.group : a.s_group, lane,
                        first, buf);
    }
  };
  if (early) issue_first();
  pdl_wait();
  pdl_trigger();
  if (!early) issue_first();
  if (int(threadIdx.x) < k + (a.has_shared ? 1 : 0)) wj[threadIdx.x] = a.w[threadIdx.x];
  for (int s = warp; s < ns; s += nw) {
    const F8Split X = f8_split_warp(a.hb + s * a.maxI, s < k ? a.I : a.Is, reinterpret_cast<__half*>(hs + s * sb), lane);
    if (lane == 0) inv[s] = X.inv;
  }
  __syncthreads();
  for (int tile = blockIdx.x; tile * 16 < a.H; tile += gridDim.x) {
    float acc0 = 0.f, acc1 = 0.f;
    for (int u = warp; u < ns * npiece; u += nw) {
      const int s = u / npiece, len = s < k ? a.I : a.Is, c0 = (u % npiece) * kDnPiece;
      if (c0 >= len) continue;
      const F8TileRows R = unit_rows(s, tile);
      const F8Split X{reinterpret_cast<const __half*>(hs + s * sb), f8_padded(len) + 8, inv[s]};
      float d0, d1;
      const int c1 = min(len, c0 + kDnPiece);
      F8Batch F = first;
      const int grp = s < k ? q.group : a.s_group;
      if (!(have_first && u == warp && tile == int(blockIdx.x))) F8Staged::first(R, c0, c1, grp, lane, F, buf);
      F8Staged::dot(R, X, c0, c1, grp, lane, F, buf, d0, d1);
      const float f = wj[s] * X.inv;
      acc0 = fmaf(d0, f, acc0);
      acc1 = fmaf(d1, f, acc1);
    }
    if constexpr (!f8s) {
      if (a.has_shared && warp < 16) {
        const int r = tile * 16 + warp;
        float v = 0.f;
        if (r < a.H) v = row_dot<TS>(static_cast<const TS*>(a.s_down) + size_t(r) * a.Is, a.hb + k * a.maxI, a.Is, lane);
        v = warp_sum(v);
        if (lane == 0) extra[warp] = wj[k] * v;
      }
    }
    if ((lane & 3) == 0) part[warp][g] = acc0, part[warp][g + 8] = acc1;
    __syncthreads();
    if (threadIdx.x < 16) {
      const int r = tile * 16 + threadIdx.x;
      if (r < a.H) {
        float t = 0.f;
        for (int w = 0; w < nw; ++w) t += part[w][threadIdx.x];
        if (!f8s && a.has_shared) t += extra[threadIdx.x];
        a.x[r] += t;
      }
    }
    __syncthreads();
  }
}

}  // namespace flashmoe::cuda
