// The decode step's dense FP8 products (DT_FP8 matrices: E4M3 codes, per-row
// fp32 block scales; device_model.cuh) with whole rows per warp: y (+)=
// W . norm(x) for the in-projections and other matvecs (matvec_fp8_rows_kernel),
// and the output projection beside the folded router
// (outproj_router_fp8_rows_kernel). The routed experts keep the tensor-core
// kernels (fp8_experts.cuh): gate_up and down by rows measured slower
// (bench/NOTES-cuda.md, "FP8 decode: whole rows per warp").
//
// Why not the tensor cores (fp8_matvec.cuh's f8_matvec_tiles): a 16-row mma
// tile made each warp load 64-byte pieces of 16 rows, and the out-projection's
// 2,048 rows gave only 128 tiles' worth of blocks. Measured one launch at a
// time in a graph of 40 (bench/micro/fp8_matvec_bench.cu, H200): the
// 35B's in-proj (12,352 x 2,048) 12.6 us on the tiles, 10.1 us here (bf16
// twin 14.3, a plain read of the bytes 6.4); its out-proj (2,048 x 4,096)
// 9.2 us on the tiles, 3.5 us here (bf16 6.5).
//
// The layout of the work:
//  - a warp takes R rows at a time, each over its slice of the columns
//    (the whole row, or 1/split of it where a row has more than NJ chunks:
//    partial sums added in a fixed order through shared memory);
//  - chunk j of a slice is 32 V consecutive columns, lane l's V codes at
//    j 32 V + V l (one 8-byte load each: a warp load reads 256 contiguous
//    bytes of one row, and a lane's codes lie in one scale block);
//  - the first group of rows' codes and scales are loaded before the PDL
//    wait (weights only), a row's block scales of the slice one per lane
//    (lanes 0..) and shuffled to the lanes whose chunk lies in that block;
//  - x (normed) is staged in shared memory chunk-major, so that a warp's
//    float4 reads of a chunk hit consecutive 16-byte words; each warp
//    computes the norm's sum of squares itself (one barrier in all);
//  - per chunk, each x float4 is read once for the R rows; codes are
//    widened exactly (cvt.rn.f16x2.e4m3x2, then to fp32) and multiplied in
//    fp32; a chunk's sum times its block scale goes to the row's sum.
#pragma once
#include "backend/cuda/fp8_matvec.cuh"
#include "backend/cuda/router.cuh"

namespace flashmoe::cuda {

constexpr int kF8RowsR = 4;                   // rows a warp takes at a time
constexpr int kF8RowsV = 8;                   // codes per lane per chunk (one 8-byte load)
constexpr int kF8RowsCW = 32 * kF8RowsV;      // columns per chunk
constexpr int kF8RowsNJ = 8;                  // chunks a warp holds per row (2,048 columns)
constexpr int kF8RowsWV = kF8RowsV / 4;       // 32-bit code words (and x float4s) per lane per chunk
constexpr int kF8RowsMinBlocks = 2;           // blocks per SM the registers are bounded for

// Warps per row for a DT_FP8 matrix of `cols` columns and scale blocks
// `group` wide in the rows kernels, or 0 where they do not apply (columns
// not a multiple of a chunk, a chunk's codes across two scale blocks, or a
// slice spanning more than 32 scale blocks: one per lane).
__host__ __device__ inline int f8_rows_split(int cols, int group) {
  if (cols <= 0 || cols % kF8RowsCW != 0 || group % kF8RowsV != 0) return 0;
  const int chunks = cols / kF8RowsCW;
  int split = 1;
  while (split <= kWarps && (chunks + split - 1) / split > kF8RowsNJ) split *= 2;
  if (split > kWarps) return 0;
  const int slice = (chunks + split - 1) / split * kF8RowsCW;
  if ((slice + group - 1) / group + 1 > 32) return 0;  // +1: a slice need not start at a block's edge
  return split;
}
// Their dynamic shared memory: x chunk-major.
inline size_t f8_rows_smem(int cols) { return size_t(cols) * 4; }

// One warp's rows in flight: codes [row][chunk][word], and per row this
// lane's scale (block c0 / group + lane of the slice).
template <int R>
struct F8RowsGroup {
  uint32_t c[R][kF8RowsNJ][kF8RowsWV];
  float s[R];
};

// d + the four codes of `word` (low byte first) times xv, widened exactly.
__device__ __forceinline__ float f8_dot4(uint32_t word, const float4& xv, float d) {
  const float2 a = e4m3x2_to_float2(word), b = e4m3x2_to_float2(word >> 16);
  d = fmaf(a.x, xv.x, d);
  d = fmaf(a.y, xv.y, d);
  d = fmaf(b.x, xv.z, d);
  return fmaf(b.y, xv.w, d);
}

// Where a warp works: its slice of the columns and its first row group.
struct F8RowsWarp {
  int split, rpb, sub, lr;
  int j0, nj;  // the slice's first chunk and its chunk count
  int c0;      // its first column
};
__device__ __forceinline__ F8RowsWarp f8_rows_warp(int cols, int split) {
  F8RowsWarp w;
  const int warp = threadIdx.x >> 5, chunks = cols / kF8RowsCW, per = (chunks + split - 1) / split;
  w.split = split;
  w.rpb = kWarps / split;
  w.sub = warp % split;
  w.lr = warp / split;
  w.j0 = min(chunks, w.sub * per);
  w.nj = min(chunks, w.j0 + per) - w.j0;
  w.c0 = w.j0 * kF8RowsCW;
  return w;
}

// A row of codes (cols bytes) and its scales (one per `group` columns).
struct F8RowRef {
  const uint8_t* w;
  const float* s;
};
// The rows of a DT_FP8 matrix (per-row block scales).
struct F8DenseRows {
  const uint8_t* W;
  const float* S;
  int cols, nbc;
  __device__ F8RowRef operator()(int r) const { return {W + size_t(r) * cols, S + size_t(r) * nbc}; }
};

// Row group g's codes and scales (rows g R .. g R + R - 1 of row_of; rows
// past nrows read its last row, their sums are dropped).
template <int R, class RowOf>
__device__ __forceinline__ void f8_rows_issue(const RowOf& row_of, int nrows, int group, const F8RowsWarp& w, int g,
                                              int lane, F8RowsGroup<R>& G) {
  const int b0 = w.c0 / group;
  const int nb = w.nj > 0 ? (w.c0 + w.nj * kF8RowsCW - 1) / group - b0 + 1 : 0;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const F8RowRef ref = row_of(min(g * R + i, nrows - 1));
    const uint8_t* wr = ref.w + w.c0 + kF8RowsV * lane;
#pragma unroll
    for (int j = 0; j < kF8RowsNJ; ++j)
      if (j < w.nj) {
        const uint2 u = ld_stream8(wr + j * kF8RowsCW);
        G.c[i][j][0] = u.x;
        G.c[i][j][1] = u.y;
      }
    G.s[i] = lane < nb ? __ldg(ref.s + b0 + lane) : 0.f;
  }
}

// x into shared memory chunk-major (float4 slot (j WV + q) 32 + l holds
// columns j CW + V l + 4q .. + 3, for V codes a lane takes per chunk:
// kF8RowsV here, 16 in fp8_gate_up_smem.cuh), zero-centred-RMS-normed with weight nw
// where nw is given (the same formula as load_x; each warp sums the
// squares itself, so no block reduction). Ends with a barrier; returns
// the norm's 1/rms(x) (1 without a norm).
template <int V = kF8RowsV>
__device__ __forceinline__ float f8_rows_stage_x(const float* __restrict__ x, const float* __restrict__ nw, float eps,
                                                int cols, float4* xs4) {
  constexpr int WV = V / 4, CW = 32 * V;
  const int lane = threadIdx.x & 31, slots = cols / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float rn = 1.f;
  if (nw) {
    float ss = 0.f;
    for (int i = lane; i < slots; i += 32) {
      const float4 v = x4[i];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = warp_sum(ss);
    rn = 1.0f / sqrtf(ss / float(cols) + eps);
  }
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int l = s % 32, q = (s / 32) % WV, j = s / (32 * WV);
    const int c = j * CW + V * l + 4 * q;
    float4 v = x4[c / 4];
    if (nw) {
      // nw as four loads: a norm weight vector need not be 16-byte aligned.
      v = make_float4(v.x * rn * (1.f + nw[c]), v.y * rn * (1.f + nw[c + 1]), v.z * rn * (1.f + nw[c + 2]),
                      v.w * rn * (1.f + nw[c + 3]));
    }
    xs4[s] = v;
  }
  __syncthreads();
  return rn;
}

// The sums of this block's row groups of row_of (bid of the nb blocks;
// grid-stride) with x staged by f8_rows_stage_x: store(g, t) takes row
// group g's R sums t (one lane calls it). G holds the warp's first group
// (f8_rows_issue of group bid * rpb + lr) where have_first.
template <int R, class RowOf, class Store>
__device__ __forceinline__ void f8_rows_run(const RowOf& row_of, int nrows, int group, const float4* xs4,
                                            const F8RowsWarp& w, int bid, int nb, F8RowsGroup<R>& G, bool have_first,
                                            const Store& store) {
  __shared__ float part[kWarps][R];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ngroups = (nrows + R - 1) / R, stride = nb * w.rpb;
  const int b0 = w.c0 / group;
  for (int gb = bid * w.rpb; gb < ngroups; gb += stride) {
    const int g = gb + w.lr;
    const bool have = g < ngroups;
    if (have && !(have_first && gb == bid * w.rpb)) f8_rows_issue(row_of, nrows, group, w, g, lane, G);
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
    if (have) {
#pragma unroll
      for (int j = 0; j < kF8RowsNJ; ++j) {
        if (j >= w.nj) break;
        const int jg = w.j0 + j;
        float d[R];
#pragma unroll
        for (int i = 0; i < R; ++i) d[i] = 0.f;
#pragma unroll
        for (int q = 0; q < kF8RowsWV; ++q) {
          const float4 xv = xs4[(jg * kF8RowsWV + q) * 32 + lane];
#pragma unroll
          for (int i = 0; i < R; ++i) d[i] = f8_dot4(G.c[i][j][q], xv, d[i]);
        }
        const int blk = (w.c0 + j * kF8RowsCW + kF8RowsV * lane) / group - b0;
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = fmaf(__shfl_sync(0xffffffffu, G.s[i], blk), d[i], acc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = warp_sum(acc[i]);
    if (w.split == 1) {
      if (have && lane == 0) store(g, acc);
      continue;
    }
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < R; ++i) part[warp][i] = acc[i];
    __syncthreads();
    if (have && w.sub == 0 && lane == 0) {
      float t[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        t[i] = 0.f;
        for (int k = 0; k < w.split; ++k) t[i] += part[w.lr * w.split + k][i];
      }
      store(g, t);
    }
    __syncthreads();
  }
}

// y[r] (+)= the R sums of row group g, rows past `rows` dropped.
struct F8StoreRows {
  float* y;
  int rows, accumulate;
  __device__ void operator()(int g, const float* t) const {
#pragma unroll
    for (int i = 0; i < kF8RowsR; ++i) {
      const int r = g * kF8RowsR + i;
      if (r < rows) y[r] = accumulate ? y[r] + t[i] : t[i];
    }
  }
};

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null) for a DT_FP8 W
// that f8_rows_split accepts; split from it. xcopy: as matvec_kernel's.
static __global__ void __launch_bounds__(kThreads, kF8RowsMinBlocks)
    matvec_fp8_rows_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S, int group, int rows, int cols,
                           const float* __restrict__ x, const float* __restrict__ nw, float eps, float* __restrict__ y,
                           int accumulate, int split, float* __restrict__ xcopy) {
  extern __shared__ __align__(16) float4 xs4[];
  const F8RowsWarp w = f8_rows_warp(cols, split);
  const int lane = threadIdx.x & 31, first = blockIdx.x * w.rpb + w.lr;
  const F8DenseRows row_of{W, S, cols, (cols + group - 1) / group};
  F8RowsGroup<kF8RowsR> G;
  const bool have_first = first < (rows + kF8RowsR - 1) / kF8RowsR;
  if (have_first) f8_rows_issue(row_of, rows, group, w, first, lane, G);
  pdl_wait();
  pdl_trigger();
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  f8_rows_stage_x(x, nw, eps, cols, xs4);
  f8_rows_run(row_of, rows, group, xs4, w, blockIdx.x, gridDim.x, G, have_first, F8StoreRows{y, rows, accumulate});
}

// outproj_router_fp8_kernel (fp8_router.cuh) with the projection by rows:
// blocks [0, nbR) the folded router's, the next nbA x += W_out . o (o = cat
// + H, splitA = f8_rows_split of W_out). The host sizes both to one
// resident wave (CudaModel::Impl::outproj_router).
static __global__ void __launch_bounds__(kThreads, kF8RowsMinBlocks)
    outproj_router_fp8_rows_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S, int group,
                                   OutRouterArgs a) {
  extern __shared__ __align__(16) float4 os4[];
  // Router blocks first (they start at once: the pick at their end is what
  // the experts wait for; they came last until session 13).
  const int rb = int(blockIdx.x), bid = rb - a.nbR, lane = threadIdx.x & 31;
  const F8RowsWarp w = f8_rows_warp(a.O, a.splitA);
  const F8DenseRows row_of{W, S, a.O, (a.O + group - 1) / group};
  F8RowsGroup<kF8RowsR> G;
  bool have_first = false;
  if (bid >= 0) {
    const int first = bid * w.rpb + w.lr;
    have_first = first < (a.H + kF8RowsR - 1) / kF8RowsR;
    if (have_first) f8_rows_issue(row_of, a.H, group, w, first, lane, G);
  }
  if (a.sel.out && rb == 0 && threadIdx.x < 32) prefetch_tables(a.sel, a.E);
  pdl_wait();
  pdl_trigger();
  if (rb < a.nbR) {
    router_block(a, rb);
    return;
  }
  f8_rows_stage_x(a.cat + a.H, nullptr, 0.f, a.O, os4);
  f8_rows_run(row_of, a.H, group, os4, w, bid, a.nbA, G, have_first, F8StoreRows{a.x, a.H, 1});
}

}  // namespace flashmoe::cuda
