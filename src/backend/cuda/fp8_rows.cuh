// The decode step's dense FP8 products (DT_FP8 matrices: E4M3 codes, per-row
// fp32 block scales; device_model.cuh) with whole rows per warp: y (+)=
// W . norm(x) for the in-projections and other matvecs (matvec_fp8_rows_kernel),
// and the output projection beside the folded router
// (outproj_router_fp8_rows_kernel).
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
#include "backend/cuda/experts.cuh"
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
// columns j CW + V l + 4q .. + 3), zero-centred-RMS-normed with weight nw
// where nw is given (the same formula as load_x; each warp sums the
// squares itself, so no block reduction). Ends with a barrier; returns
// the norm's 1/rms(x) (1 without a norm).
__device__ __forceinline__ float f8_rows_stage_x(const float* __restrict__ x, const float* __restrict__ nw, float eps,
                                                int cols, float4* xs4) {
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
    const int l = s % 32, q = (s / 32) % kF8RowsWV, j = s / (32 * kF8RowsWV);
    const int c = j * kF8RowsCW + kF8RowsV * l + 4 * q;
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
// blocks [0, nbA) x += W_out . o (o = cat + H, splitA = f8_rows_split of
// W_out), the others the folded router's blocks.
static __global__ void __launch_bounds__(kThreads, kF8RowsMinBlocks)
    outproj_router_fp8_rows_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S, int group,
                                   OutRouterArgs a) {
  extern __shared__ __align__(16) float4 os4[];
  const int bid = int(blockIdx.x), lane = threadIdx.x & 31;
  const F8RowsWarp w = f8_rows_warp(a.O, a.splitA);
  const F8DenseRows row_of{W, S, a.O, (a.O + group - 1) / group};
  F8RowsGroup<kF8RowsR> G;
  bool have_first = false;
  if (bid < a.nbA) {
    const int first = bid * w.rpb + w.lr;
    have_first = first < (a.H + kF8RowsR - 1) / kF8RowsR;
    if (have_first) f8_rows_issue(row_of, a.H, group, w, first, lane, G);
  }
  if (a.sel.out && bid == a.nbA && threadIdx.x < 32) prefetch_tables(a.sel, a.E);
  pdl_wait();
  pdl_trigger();
  if (bid >= a.nbA) {
    router_block(a, bid - a.nbA);
    return;
  }
  f8_rows_stage_x(a.cat + a.H, nullptr, 0.f, a.O, os4);
  f8_rows_run(row_of, a.H, group, os4, w, bid, a.nbA, G, have_first, F8StoreRows{a.x, a.H, 1});
}

// The rows of one slot of the routed experts' gate_up (FP8 expert blocks,
// QExpert) or of an FP8 shared expert (a DMat: gate rows, then up rows,
// per-row scales), interleaved: row 2 r is gate row r, 2 r + 1 up row r,
// so that a group of R rows ends with R / 2 rows of h.
struct F8GateUpRows {
  const uint8_t* gate;
  const uint8_t* up;
  const float* gs;
  const float* us;
  int H, nbc, block_rows;  // scale rows: one per block_rows weight rows
  __device__ F8RowRef operator()(int v) const {
    const int r = v >> 1;
    const size_t sr = size_t(r / block_rows) * nbc;
    return (v & 1) ? F8RowRef{up + size_t(r) * H, us + sr} : F8RowRef{gate + size_t(r) * H, gs + sr};
  }
};
// Rows a warp of gate_up takes at a time: one gate / up pair (with four, the
// expert's pointers beside the codes spilled at the 2-blocks-per-SM bound).
constexpr int kF8GuR = 2;
static_assert(kF8GuR % 2 == 0, "a row group holds whole gate / up pairs");

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn) by whole rows per warp;
// blockIdx.y = slot j (as gate_up_fp8_mma_kernel, fp8_experts.cuh, with the
// same pick and presel duties of block (0,0)); the shared expert, where
// there is one, is FP8 too. split: f8_rows_split of H (the same for the
// routed experts' and the shared expert's block widths).
static __global__ void __launch_bounds__(kThreads, kF8RowsMinBlocks)
    gate_up_fp8_rows_kernel(MoeArgs a, QExpert q, int split) {
  extern __shared__ __align__(16) float4 xs4[];
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I, nrows = 2 * I;
  const F8RowsWarp w = f8_rows_warp(a.H, split);
  if (int(blockIdx.x) * w.rpb * kF8GuR >= nrows) return;
  const int lane = threadIdx.x & 31;
  const bool pick = !shared && a.logits && !a.presel;  // uniform over the block
  const int group = shared ? a.s_group : q.group, nbc = (a.H + group - 1) / group;
  auto rows_of = [&](const uint8_t* B) {
    if (shared) {
      const uint8_t* W = static_cast<const uint8_t*>(a.s_gu);
      return F8GateUpRows{W, W + size_t(I) * a.H, a.s_gu_sc, a.s_gu_sc + size_t(I) * nbc, a.H, nbc, 1};
    }
    return F8GateUpRows{B, B + q.up_w, reinterpret_cast<const float*>(B + q.gate_s),
                        reinterpret_cast<const float*>(B + q.up_s), a.H, nbc, q.block_rows};
  };
  // The warp's first rows: a shared expert's before the wait, a routed
  // one's once its pointer is known (not where this block picks the
  // experts itself: then after x is staged).
  const int first = blockIdx.x * w.rpb + w.lr;
  const bool have_first = !pick && first < (nrows + kF8GuR - 1) / kF8GuR;
  F8RowsGroup<kF8GuR> G;
  if (shared && have_first) f8_rows_issue(rows_of(nullptr), nrows, group, w, first, lane, G);
  if (pick && threadIdx.x < 32) prefetch_tables(a.tsel, a.E);
  pdl_wait();
  pdl_trigger();
  float* h = a.hb + size_t(j) * a.maxI;
  auto store = [&](int g, const float* t) {
#pragma unroll
    for (int i = 0; i < kF8GuR; i += 2) {
      const int r = (g * kF8GuR + i) >> 1;
      if (r < I) h[r] = siluf_(t[i]) * t[i + 1];
    }
  };
  if (pick) {  // apart, so that no codes are held across the top-k (registers)
    const float rx = f8_rows_stage_x(a.x, a.norm_w, a.eps, a.H, xs4);
    const uint8_t* B = static_cast<const uint8_t*>(pick_block_expert(a, j, a.folded ? rx : 1.0f));
    f8_rows_run(rows_of(B), nrows, group, xs4, w, blockIdx.x, gridDim.x, G, false, store);
    return;
  }
  const uint8_t* B = nullptr;
  if (!shared) {
    B = static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
    if (have_first) f8_rows_issue(rows_of(B), nrows, group, w, first, lane, G);
  }
  const float rx = f8_rows_stage_x(a.x, a.norm_w, a.eps, a.H, xs4);
  if (a.presel && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 32)
    topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rx : 1.0f, a.w_out);
  f8_rows_run(rows_of(B), nrows, group, xs4, w, blockIdx.x, gridDim.x, G, have_first, store);
}

// Rows of x a warp of down takes at a time.
constexpr int kF8DnR = 2;
// down's chunks: the slots' h side by side (slot s's columns at s I, the
// shared expert's as slot k, its width Is equal to I), each row's chunks
// spread over `split` warps as the dense rows' columns (f8_rows_split of
// slots * I; its scale-block limit does not apply: down loads each chunk's
// scale per lane). 0: not this kernel (I not a multiple of a chunk, or
// too many chunks).
inline int f8_down_rows_split(int slots, int I, int group) {
  if (I % kF8RowsCW != 0 || group % kF8RowsV != 0) return 0;
  const int chunks = slots * I / kF8RowsCW;
  for (int split = 1; split <= kWarps; split *= 2)
    if ((chunks + split - 1) / split <= kF8RowsNJ) return split;
  return 0;
}

// x[r] += sum_j w_j * down_j[r] . h_j by whole rows per warp (as
// down_fp8_mma_kernel, fp8_experts.cuh): a warp takes kF8DnR rows of x
// over its slice of the slots' chunks; a chunk's codes are one 8-byte load
// a lane, its scale (times the slot's weight) one load a lane; the h of
// every slot staged chunk-major; the split warps' sums added in a fixed
// order. The shared expert, where there is one, is FP8 (per-row scales).
static __global__ void __launch_bounds__(kThreads, kF8RowsMinBlocks)
    down_fp8_rows_kernel(MoeArgs a, QExpert q, int split) {
  extern __shared__ __align__(16) float4 hs4[];
  __shared__ const uint8_t* ptr[33];
  __shared__ float wj[33];
  __shared__ float part[kWarps][kF8DnR];
  constexpr int R = kF8DnR;
  const int k = a.k, ns = k + (a.has_shared ? 1 : 0), I = a.I, cps = I / kF8RowsCW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const F8RowsWarp w = f8_rows_warp(ns * I, split);
  const int nbcI = (I + q.group - 1) / q.group, nbcS = a.has_shared ? (I + a.s_group - 1) / a.s_group : 0;
  pdl_wait();
  pdl_trigger();
  if (int(threadIdx.x) < k)
    ptr[threadIdx.x] = static_cast<const uint8_t*>(a.sel ? a.sel[k + threadIdx.x] : a.down_tab[a.ids[threadIdx.x]]);
  if (int(threadIdx.x) < ns) wj[threadIdx.x] = a.w[threadIdx.x];
  __syncthreads();
  // Row r's codes and scale (times the slot's weight) of chunk j of the slice.
  auto issue = [&](int g, uint32_t (&c)[R][kF8RowsNJ][kF8RowsWV], float (&sc)[R][kF8RowsNJ]) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = min(g * R + i, a.H - 1);
#pragma unroll
      for (int j = 0; j < kF8RowsNJ; ++j)
        if (j < w.nj) {
          const int jg = w.j0 + j, s = jg / cps, col = (jg - s * cps) * kF8RowsCW + kF8RowsV * lane;
          const uint8_t* codes;
          float scale;
          if (s < k) {
            codes = ptr[s] + size_t(r) * I + col;
            scale = __ldg(reinterpret_cast<const float*>(ptr[s] + q.dn_s) + size_t(r / q.block_rows) * nbcI +
                          col / q.group);
          } else {
            codes = static_cast<const uint8_t*>(a.s_down) + size_t(r) * I + col;
            scale = __ldg(a.s_down_sc + size_t(r) * nbcS + col / a.s_group);
          }
          const uint2 u = ld_stream8(codes);
          c[i][j][0] = u.x;
          c[i][j][1] = u.y;
          sc[i][j] = scale * wj[s];
        }
    }
  };
  uint32_t c[R][kF8RowsNJ][kF8RowsWV];
  float sc[R][kF8RowsNJ];
  const int ngroups = (a.H + R - 1) / R, stride = gridDim.x * w.rpb;
  const int first = blockIdx.x * w.rpb + w.lr;
  if (first < ngroups) issue(first, c, sc);
  // The slots' h chunk-major (float4 slot (jg WV + q) 32 + l: columns
  // jg CW + V l + 4 q of the side-by-side h).
  for (int t = threadIdx.x; t < ns * I / 4; t += blockDim.x) {
    const int l = t % 32, qd = (t / 32) % kF8RowsWV, jg = t / (32 * kF8RowsWV);
    const int col = jg * kF8RowsCW + kF8RowsV * l + 4 * qd, s = col / I;
    hs4[t] = *reinterpret_cast<const float4*>(a.hb + size_t(s) * a.maxI + (col - s * I));
  }
  __syncthreads();
  for (int gb = blockIdx.x * w.rpb; gb < ngroups; gb += stride) {
    const int g = gb + w.lr;
    const bool have = g < ngroups;
    if (have && gb != blockIdx.x * w.rpb) issue(g, c, sc);
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
        for (int qd = 0; qd < kF8RowsWV; ++qd) {
          const float4 xv = hs4[(jg * kF8RowsWV + qd) * 32 + lane];
#pragma unroll
          for (int i = 0; i < R; ++i) d[i] = f8_dot4(c[i][j][qd], xv, d[i]);
        }
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = fmaf(sc[i][j], d[i], acc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = warp_sum(acc[i]);
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < R; ++i) part[warp][i] = acc[i];
    __syncthreads();
    if (have && w.sub == 0 && lane < R) {
      const int r = g * R + lane;
      if (r < a.H) {
        float t = 0.f;
        for (int kk = 0; kk < w.split; ++kk) t += part[w.lr * w.split + kk][lane];
        a.x[r] += t;
      }
    }
    __syncthreads();
  }
}

}  // namespace flashmoe::cuda
