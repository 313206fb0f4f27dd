// The decode step's matrix-vector product for dense GGUF matrices repacked
// at upload (gguf_dense_layout.cuh: in-projections, out-projections,
// lm_head). A warp takes kGDenseRows consecutive rows of one part at a time
// (a unit); lane l takes the column groups of 32 at l, l + 32, ... (a tile
// of 1024 columns per step), so each lane issues, per row, one 16-byte load
// of codes and one 8-byte load of its group's scale pair (plus the high
// bits of 5/6/8-bit kinds), all rows' loads before the arithmetic, and the
// warp's loads of a row are contiguous. (The next tile's loads issued
// before the current tile's arithmetic, two register sets a warp, spilled
// ~1.8 KB a thread with all kinds in one kernel at 128 registers: not
// done.) x (normed once per block) is kept
// in shared memory with each group's float4s swizzled (no bank conflicts
// when the 32 lanes read 32 groups) and its groups' sums beside it (the min
// term of Q4_K / Q5_K: scale * sum(code x) - min * sum(x)). Few units
// (out-projections: 2048 rows of 4096 columns): `split` warps share a unit,
// each a share of the tiles, partials summed in a fixed order.
#pragma once
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gguf_blocks.cuh"
#include "backend/cuda/gguf_dense_layout.cuh"

namespace flashmoe::cuda {

constexpr int kGDenseRows = 4;  // rows a warp at a time (a unit)

// Whether every part of g is repacked.
FM_HD bool gmat_dense(const GMat& g) {
  for (int i = 0; i < g.n; ++i)
    if (!gdense_kind(g.kind[i])) return false;
  return g.n > 0;
}
// Units of g (a part's rows in runs of kGDenseRows; runs never cross parts).
FM_HD int gdense_units(const GMat& g) {
  int u = 0;
  for (int i = 0; i < g.n; ++i) u += (g.row0[i + 1] - g.row0[i] + kGDenseRows - 1) / kGDenseRows;
  return u;
}
// Unit u of g: its part, first row and row count; false past the last.
FM_HD bool gdense_unit(const GMat& g, int u, int& part, int& r0, int& n) {
  for (int i = 0; i < g.n; ++i) {
    const int rows = g.row0[i + 1] - g.row0[i], runs = (rows + kGDenseRows - 1) / kGDenseRows;
    if (u < runs) {
      part = i;
      r0 = g.row0[i] + u * kGDenseRows;
      n = rows - u * kGDenseRows < kGDenseRows ? rows - u * kGDenseRows : kGDenseRows;
      return true;
    }
    u -= runs;
  }
  return false;
}

// Tile t's loads for the unit's rows (n of them, rb bytes apart from
// `rows`) into d: this lane's group 32 t + lane of G.
template <int H>
__device__ __forceinline__ void gdense_tile_load(const uint8_t* rows, size_t rb, int n, int G, int t, int lane,
                                                 GDenseRows<H, kGDenseRows>& d) {
  const int gi = 32 * t + lane;
  if (gi >= G) return;
  const size_t at = size_t(gi >> 3) * (192 + 32 * H);  // the group's repacked block
#pragma unroll
  for (int i = 0; i < kGDenseRows; ++i)
    gdense_load_group(rows + size_t(i < n ? i : 0) * rb + at, gi & 7, H, d.lo[i], d.hi[i], d.p0[i], d.p1[i]);
}
template <int H, bool MIN>
__device__ __forceinline__ void gdense_tile_dot(const GDenseRows<H, kGDenseRows>& d, int G, int t, int lane,
                                                const float* xz, const float* sx, float off,
                                                float (&acc)[kGDenseRows]) {
  const int gi = 32 * t + lane;
  if (gi >= G) return;
  gdense_rows_dot<H, MIN, kGDenseRows>(d, xz + 32 * gi, gi & 7, MIN ? sx[gi] : 0.f, off, acc);
}

// acc[i] += row i . x over this warp's tiles t = sub, sub + split, ...
template <int H, bool MIN>
__device__ __forceinline__ void gdense_rows(const uint8_t* rows, size_t rb, int n, int G, const float* xz,
                                            const float* sx, float off, int sub, int split, int lane,
                                            float (&acc)[kGDenseRows]) {
  for (int t = sub; 32 * t < G; t += split) {
    GDenseRows<H, kGDenseRows> a;
    gdense_tile_load<H>(rows, rb, n, G, t, lane, a);
    gdense_tile_dot<H, MIN>(a, G, t, lane, xz, sx, off, acc);
  }
}

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null), every part of
// g repacked. Shared memory (gdense_smem): x, x swizzled, the group sums.
// Registers cut for 2 blocks an SM (127, no spills; cut for 3: 80
// registers, ~100 bytes spilled, measured slower in session 8's rounds).
static __global__ void __launch_bounds__(kThreads, 2) gdense_matvec_kernel(const void* __restrict__ W, GMat g, int cols,
                                                                        int split, const float* __restrict__ x,
                                                                        const float* __restrict__ nw, float eps,
                                                                        float* __restrict__ y, int accumulate,
                                                                        float* __restrict__ xcopy) {
  extern __shared__ __align__(16) float gds[];
  __shared__ float part[kGDenseRows][kWarps];
  float* const xs = gds;
  float* const xz = gds + cols;
  float* const sx = xz + cols;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = kWarps / split, sub = warp % split, lu = warp / split, G = cols / 32;
  const int units = gdense_units(g);
  auto rows_of = [&](int p, int r0, size_t& rb) {
    rb = gguf_row_bytes(g.kind[p], cols);
    return static_cast<const uint8_t*>(W) + g.off[p] + size_t(r0 - g.row0[p]) * rb;
  };
  {  // the warp's first unit into L2 before the wait (weights only)
    int p, r0, n;
    size_t rb;
    if (gdense_unit(g, blockIdx.x * rpb + lu, p, r0, n)) {
      const uint8_t* r = rows_of(p, r0, rb);
      const size_t share = (size_t(n) * rb / split + 127) / 128 * 128;
      const size_t from = share * sub, all = size_t(n) * rb;
      if (from < all) warp_prefetch(r + from, std::min(share, all - from), lane);
    }
  }
  NormPre pre;
  norm_preload(nw, cols, true, pre);
  pdl_wait();
  pdl_trigger();
  // The layer's input residual, kept for a folded router (outproj_router_kernel).
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  load_x(x, nw, eps, cols, xs, &pre);
  // Float4 c of group gi goes to 8 gi + (c ^ gi % 8); the group's sum from
  // its 8 float4s (8 consecutive lanes: cols / 4 is a multiple of 64, so
  // whole warps take part in the shuffles).
  for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
    const float4 v = reinterpret_cast<const float4*>(xs)[c];
    const int gi = c >> 3;
    reinterpret_cast<float4*>(xz)[8 * gi + ((c & 7) ^ (gi & 7))] = v;
    float s = (v.x + v.y) + (v.z + v.w);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    if ((c & 7) == 0) sx[gi] = s;
  }
  __syncthreads();
  for (int u0 = blockIdx.x * rpb; u0 < units; u0 += gridDim.x * rpb) {
    int p = 0, r0 = 0, n = 0;
    const bool ok = gdense_unit(g, u0 + lu, p, r0, n);
    float acc[kGDenseRows] = {};
    if (ok) {
      size_t rb;
      const uint8_t* r = rows_of(p, r0, rb);
      const GDenseKind in = gdense_info(g.kind[p]);
      const float off = float(in.off);
      gdense_with_kind(in, [&](auto h, auto mn) {
        gdense_rows<decltype(h)::value, decltype(mn)::value>(r, rb, n, G, xz, sx, off, sub, split, lane, acc);
      });
    }
#pragma unroll
    for (int i = 0; i < kGDenseRows; ++i) acc[i] = warp_sum(acc[i]);
    if (split == 1) {
      if (ok && lane == 0)
        for (int i = 0; i < n; ++i) y[r0 + i] = accumulate ? y[r0 + i] + acc[i] : acc[i];
      continue;
    }
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < kGDenseRows; ++i) part[i][warp] = acc[i];
    __syncthreads();
    if (ok && sub == 0 && lane == 0)
      for (int i = 0; i < n; ++i) {
        float t = 0.f;
        for (int k = 0; k < split; ++k) t += part[i][lu * split + k];
        y[r0 + i] = accumulate ? y[r0 + i] + t : t;
      }
    __syncthreads();
  }
}

// ------------------------------------------------------------------ host side

// gdense_matvec_kernel's dynamic shared memory for rows of cols columns.
inline size_t gdense_smem(int cols) { return size_t(2 * cols + cols / 32) * 4; }
// Warps per unit (1, 2, 4 or 8, at most the tiles of a row) for `resident`
// blocks in one wave: the split whose blocks fill their last wave best
// (a wave of 1.46 units a warp, the 35B's in-projections at split 1, left a
// third of the second wave idle), the smaller one unless a larger fills
// better by 5%.
inline int gdense_split(const GMat& g, int cols, int resident) {
  const int units = gdense_units(g), tiles = (cols / 32 + 31) / 32;
  int best = 1;
  double fill_best = 0;
  for (int s = 1; s <= kWarps && s <= tiles; s *= 2) {
    const int blocks = (units + kWarps / s - 1) / (kWarps / s), waves = (blocks + resident - 1) / resident;
    const double fill = double(blocks) / (double(waves) * resident);
    if (fill > fill_best + 0.05) best = s, fill_best = fill;
  }
  return best;
}

}  // namespace flashmoe::cuda
