// Products over FP8 block weights in the decode step (DT_FP8 matrices:
// E4M3 codes, per-row fp32 block scales; device_model.cuh). Blocks a
// multiple of 64 columns wide (Qwen's and DeepSeek's releases: 128) go to
// the tensor cores (matvec_fp8_mma_kernel, fp8_mma.cuh). Other block widths
// (a multiple of 16) take the FFMA kernel below: the codes read as stored,
// 16 per 16-byte load, widened in registers (cvt.rn.f16x2.e4m3x2: exact)
// and multiplied against fp32 x; a load's 16 columns lie in one scale
// block, so each load's dot is scaled once.
#pragma once
#include "backend/cuda/fp8_mma.cuh"
#include "backend/cuda/fp8_staged.cuh"
#include "backend/cuda/matvec.cuh"

namespace flashmoe::cuda {

// Storage tag of a DT_FP8 matrix where a kernel is templated on the type.
struct F8Rows {};

// Two E4M3 codes (low byte first) as two floats, exactly.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// The unscaled dot of 16 codes with xs[0..16) (16-byte aligned).
__device__ __forceinline__ float fp8_dot16(const uint4& v, const float* xs) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  float d = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = *reinterpret_cast<const float4*>(xs + 4 * i);
    const float2 a = e4m3x2_to_float2(u[i]), b = e4m3x2_to_float2(u[i] >> 16);
    d = fmaf(a.x, x.x, d);
    d = fmaf(a.y, x.y, d);
    d = fmaf(b.x, x.z, d);
    d = fmaf(b.y, x.w, d);
  }
  return d;
}

// One warp's partial dot of the codes w[0, cols) (columns col0.. of a row
// whose block scales are sc) with xs.
__device__ __forceinline__ float fp8_row_dot(const uint8_t* __restrict__ w, const float* __restrict__ sc, int group,
                                             int col0, const float* xs, int cols, int lane) {
  float acc0 = 0.f, acc1 = 0.f;
  int c = lane * 16;
#pragma unroll 2
  for (; c + 512 < cols; c += 1024) {
    const uint4 a = ld_stream(w + c), b = ld_stream(w + c + 512);
    const float sa = __ldg(sc + (col0 + c) / group), sb = __ldg(sc + (col0 + c + 512) / group);
    acc0 += sa * fp8_dot16(a, xs + c);
    acc1 += sb * fp8_dot16(b, xs + c + 512);
  }
  if (c < cols) acc0 += __ldg(sc + (col0 + c) / group) * fp8_dot16(ld_stream(w + c), xs + c);
  return acc0 + acc1;
}

// Up to R rows at once (row i's codes at w + i * step, its scales at sc + i
// * sstep; n <= R valid): all the rows' loads issued before any is used.
// One column step at a time: two (2R loads in flight) measured 0.53x
// bf16's tg128 against 0.79x for this on the 35B (register spills under
// the kernel's 64-register bound; bench/NOTES-cuda.md, FP8).
template <int R>
__device__ __forceinline__ void fp8_rows_dot(const uint8_t* __restrict__ w, size_t step, const float* __restrict__ sc,
                                             size_t sstep, int group, int col0, int n, const float* xs, int cols,
                                             int lane, float* out) {
  float a0[R];
#pragma unroll
  for (int i = 0; i < R; ++i) a0[i] = 0.f;
  for (int c = lane * 16; c < cols; c += 512) {
    uint4 p[R];
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < n) p[i] = ld_stream(w + i * step + c);
    const float* x = xs + c;
    const int b = (col0 + c) / group;
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < n) a0[i] += __ldg(sc + i * sstep + b) * fp8_dot16(p[i], x);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) out[i] = a0[i];
}

// y[r] (+)= W[r,:] . xs for a DT_FP8 W (as matvec_rows: `split` warps per
// row, blocks grid-stride over rows, `per` rows per warp at a time).
__device__ __forceinline__ void fp8_matvec_rows(const uint8_t* __restrict__ W, const float* __restrict__ S, int group,
                                                int rows, int cols, const float* xs, float* __restrict__ y,
                                                int accumulate, int split, int per) {
  __shared__ float part[4][kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = kWarps / split, sub = warp % split, lr = warp / split, chunk = cols / split;
  const int stride = gridDim.x * rpb, nbc = (cols + group - 1) / group;
  for (int r0 = blockIdx.x * rpb; r0 < rows; r0 += per * stride) {
    const int r = r0 + lr;
    int n = 0;
    while (n < per && r + n * stride < rows) ++n;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (n > 0)
      fp8_rows_dot<4>(W + size_t(r) * cols + sub * chunk, size_t(stride) * cols, S + size_t(r) * nbc,
                      size_t(stride) * nbc, group, sub * chunk, n, xs + sub * chunk, chunk, lane, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = warp_sum(acc[i]);
    if (split == 1) {
      if (lane == 0)
        for (int i = 0; i < n; ++i) {
          const int ri = r + i * stride;
          y[ri] = accumulate ? y[ri] + acc[i] : acc[i];
        }
      continue;
    }
    if (lane == 0)
      for (int i = 0; i < 4; ++i) part[i][warp] = acc[i];
    __syncthreads();
    if (sub == 0 && lane == 0)
      for (int i = 0; i < n; ++i) {
        float t = 0.f;
        for (int k = 0; k < split; ++k) t += part[i][lr * split + k];
        const int ri = r + i * stride;
        y[ri] = accumulate ? y[ri] + t : t;
      }
    __syncthreads();
  }
}

// y[r] (+)= W[r,:] . norm(x) for a DT_FP8 W (norm skipped when nw is null);
// as matvec_kernel. per: rows per warp at a time (1 to 4).
static __global__ void __launch_bounds__(kThreads, 4)
    matvec_fp8_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S, int group, int rows, int cols,
                      const float* __restrict__ x, const float* __restrict__ nw, float eps, float* __restrict__ y,
                      int accumulate, int split, int pf_rows, int per, float* __restrict__ xcopy) {
  extern __shared__ __align__(16) float xs[];
  prefetch_rows(W, rows, cols, split, pf_rows);
  NormPre pre;
  norm_preload(nw, cols, true, pre);
  pdl_wait();
  pdl_trigger();
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  if (!nw) {
    fp8_matvec_rows(W, S, group, rows, cols, x, y, accumulate, split, per);
    return;
  }
  load_x(x, nw, eps, cols, xs, &pre);
  fp8_matvec_rows(W, S, group, rows, cols, xs, y, accumulate, split, per);
}

// Warps per 16-row tile in matvec_fp8_mma_kernel: doubled until a warp's
// slice is one batch (kF8Batch steps, fp8_staged.cuh), then while the tiles
// give fewer than 4 warps per SM.
inline int f8_mma_split(int rows, int cols, int sms) {
  const int tiles = (rows + 15) / 16;
  int s = 1;
  while (s < kWarps && f8_padded((cols + s - 1) / s) > kF8Batch * kF8Step) s *= 2;
  while (s < kWarps && tiles * s < 4 * sms && cols / (2 * s) >= 2 * kF8Step) s *= 2;
  return s;
}
// Whether matvec_fp8_mma_kernel norms and splits x in one pass (no fp32 copy
// of the normed x in shared memory): its condition (NormPre::on).
__host__ __device__ inline bool f8_norm_fused(const float* nw, int cols) { return nw && cols <= kNormPer * kThreads; }
// Its dynamic shared memory: x normed (fp32, unless fused), x split for the
// mma, then the warps' slots (fp8_staged.cuh).
inline size_t f8_mma_matvec_smem(int cols, bool fused) {
  const size_t a = (fused ? 0 : size_t(cols) * 4) + (f8_split_bytes(cols) + 15) / 16 * 16;
  return a + f8_warp_bufs(kWarps);
}

// The tiles' rows of W for lane g of a warp: rows tile * 16 + g and + 8.
__device__ __forceinline__ F8TileRows f8_dmat_rows(const uint8_t* W, const float* S, int rows, int cols, int nbc,
                                                   int tile, int g) {
  const int r0 = tile * 16 + g, r1 = r0 + 8;
  F8TileRows R;
  R.w0 = r0 < rows ? W + size_t(r0) * cols : nullptr;
  R.w1 = r1 < rows ? W + size_t(r1) * cols : nullptr;
  R.s0 = S + size_t(r0 < rows ? r0 : 0) * nbc;
  R.s1 = S + size_t(r1 < rows ? r1 : 0) * nbc;
  return R;
}

// This warp's share of a DT_FP8 matrix in f8_matvec_tiles: `split` warps
// per 16-row tile, each a slice [k0, k1) of the columns; its first tile.
struct F8WarpSlice {
  int tpb, sub, lt, k0, k1, tile;
};
__device__ __forceinline__ F8WarpSlice f8_warp_slice(int cols, int split, int bid) {
  const int warp = threadIdx.x >> 5;
  F8WarpSlice w;
  w.tpb = kWarps / split;
  w.sub = warp % split;
  w.lt = warp / split;
  const int slice = f8_padded((cols + split - 1) / split);
  w.k0 = min(cols, w.sub * slice);
  w.k1 = min(cols, w.k0 + slice);
  w.tile = bid * w.tpb + w.lt;
  return w;
}

// y[r] (+)= W[r,:] . X for a DT_FP8 W whose block width is a multiple of
// 64, by this block (bid of the nb blocks doing W): a warp takes a tile of
// 16 rows times a slice of the columns (`split` warps per tile, partial
// sums added in a fixed order), blocks stride over the tiles. first: the
// warp's first tile's codes (f8_matvec_first) where have_first; buf: the
// warp's slots (fp8_staged.cuh).
__device__ __forceinline__ void f8_matvec_tiles(const uint8_t* __restrict__ W, const float* __restrict__ S, int group,
                                                int rows, int cols, const F8Split& X, float* __restrict__ y,
                                                int accumulate, int split, int bid, int nb,
                                                const F8Batch& first, bool have_first, uint4* buf) {
  __shared__ float part[kWarps][16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const F8WarpSlice ws = f8_warp_slice(cols, split, bid);
  const int tpb = ws.tpb, lt = ws.lt, k0 = ws.k0, k1 = ws.k1;
  const int ntiles = (rows + 15) / 16, nbc = (cols + group - 1) / group;
  for (int t0 = bid * tpb; t0 < ntiles; t0 += nb * tpb) {
    const int tile = t0 + lt;
    float d0 = 0.f, d1 = 0.f;
    if (tile < ntiles && k0 < k1) {
      const F8TileRows R = f8_dmat_rows(W, S, rows, cols, nbc, tile, g);
      F8Batch F = first;
      if (!(have_first && t0 == bid * tpb)) F8Staged::first(R, k0, k1, group, lane, F, buf);
      F8Staged::dot(R, X, k0, k1, group, lane, F, buf, d0, d1);
    }
    if (split == 1) {
      if ((lane & 3) == 0 && tile < ntiles) {
        const int r0 = tile * 16 + g, r1 = r0 + 8;
        if (r0 < rows) y[r0] = accumulate ? y[r0] + d0 * X.inv : d0 * X.inv;
        if (r1 < rows) y[r1] = accumulate ? y[r1] + d1 * X.inv : d1 * X.inv;
      }
      continue;
    }
    if ((lane & 3) == 0) part[warp][g] = d0, part[warp][g + 8] = d1;
    __syncthreads();
    if (int(threadIdx.x) < tpb * 16) {
      const int l2 = threadIdx.x / 16, i = threadIdx.x % 16, r = (t0 + l2) * 16 + i;
      if (r < rows) {
        float s = 0.f;
        for (int k = 0; k < split; ++k) s += part[l2 * split + k][i];
        s *= X.inv;
        y[r] = accumulate ? y[r] + s : s;
      }
    }
    __syncthreads();
  }
}

// The first tile of this warp (as f8_matvec_tiles) into L2.
__device__ __forceinline__ void f8_matvec_prefetch(const uint8_t* W, const float* S, int group, int rows, int cols,
                                                   int split, int bid) {
  const F8WarpSlice ws = f8_warp_slice(cols, split, bid);
  if (ws.tile < (rows + 15) / 16)
    f8_tile_prefetch(f8_dmat_rows(W, S, rows, cols, (cols + group - 1) / group, ws.tile, (threadIdx.x & 31) >> 2),
                     ws.k0, ws.k1, threadIdx.x & 31);
}

// The codes of this warp's first tile (as f8_matvec_tiles) on their way
// (fp8_staged.cuh): the weights are known before the PDL wait, so these loads
// are in flight while the previous kernel ends and x is normed and split.
// Whether the warp has a first tile.
__device__ __forceinline__ bool f8_matvec_first(const uint8_t* W, const float* S, int group, int rows, int cols,
                                                int split, int bid, F8Batch& F, uint4* buf) {
  const F8WarpSlice ws = f8_warp_slice(cols, split, bid);
  if (!(ws.tile < (rows + 15) / 16 && ws.k0 < ws.k1)) return false;
  F8Staged::first(f8_dmat_rows(W, S, rows, cols, (cols + group - 1) / group, ws.tile, (threadIdx.x & 31) >> 2), ws.k0,
           ws.k1, group, threadIdx.x & 31, F, buf);
  return true;
}

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null) for a DT_FP8 W
// whose block width is a multiple of 64, on the tensor cores
// (f8_matvec_tiles). pf: prefetch the first tile's rows into L2 before the
// PDL wait, where its first batch of codes (which goes out there in any
// case) does not cover the warp's slice.
static __global__ void __launch_bounds__(kThreads, 3)
    matvec_fp8_mma_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S, int group, int rows, int cols,
                          const float* __restrict__ x, const float* __restrict__ nw, float eps, float* __restrict__ y,
                          int accumulate, int split, int pf, float* __restrict__ xcopy) {
  // [cols] x normed (unless normed and split in one pass), its split
  // (f8_split_bytes), the warps' slots (f8_mma_matvec_smem).
  extern __shared__ __align__(16) float xs[];
  const bool fused = f8_norm_fused(nw, cols);
  __half* sp = reinterpret_cast<__half*>(xs + (fused ? 0 : cols));
  uint4* buf = f8_warp_buf(reinterpret_cast<char*>(sp) + (f8_split_bytes(cols) + 15) / 16 * 16);
  if (pf) f8_matvec_prefetch(W, S, group, rows, cols, split, blockIdx.x);
  F8Batch first;
  const bool have_first = f8_matvec_first(W, S, group, rows, cols, split, blockIdx.x, first, buf);
  NormPre pre;
  norm_preload(nw, cols, true, pre);
  pdl_wait();
  pdl_trigger();
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  F8Split X;
  if (fused) {
    float rx;
    X = f8_norm_split_block(x, eps, cols, pre, sp, &rx);
  } else {
    load_x(x, nw, eps, cols, xs, &pre);
    X = f8_split_block(xs, cols, sp);
  }
  f8_matvec_tiles(W, S, group, rows, cols, X, y, accumulate, split, blockIdx.x, gridDim.x, first, have_first, buf);
}

}  // namespace flashmoe::cuda
