// The batched prefill's product for bf16 weights (every published
// checkpoint): gemm.cuh's split-bf16 arithmetic, with the activations split
// into hi/lo bf16 rows once before the product (split_rows_kernel) instead of
// in every block, so the tiles go from global to shared memory untouched:
// cp.async in a 3-stage pipeline (the loads of two tiles in flight while a
// third is multiplied), 8 warps on a 128-column tile.
#pragma once
#include <mma.h>

#include "backend/cuda/gemm.cuh"

namespace flashmoe::cuda {

// hi[i] = bf16(x[i]), lo[i] = bf16(x[i] - hi[i]) for rows [rows][cols] (row stride ld).
__global__ void split_rows_kernel(const float* __restrict__ x, int rows, int cols, int ld, __nv_bfloat16* hi,
                                  __nv_bfloat16* lo) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / size_t(cols), c = i % size_t(cols);
    split_bf16(x[r * ld + c], hi[i], lo[i]);
  }
}

constexpr int kPipeBN = 128, kPipeStages = 3, kPipeThreads = 256;

// gemm_pipe_kernel's blocks along the outputs (grid x): kPipeBN columns a
// block, or kPipeBN / 2 gate/up pairs for a swiglu product. Also what a
// tile's count reaches once every block of the tile is stored (tile_wait).
inline int pipe_blocks_x(const GemmArgs& a) {
  return a.mode == GEMM_SWIGLU ? (a.half + kPipeBN / 2 - 1) / (kPipeBN / 2) : (a.N + kPipeBN - 1) / kPipeBN;
}

// BM rows (tokens) by kPipeBN columns per block, BK deep per pipeline stage
// (shared-memory rows padded by 16 bytes: conflict-free fragment loads).
template <int BM, int BK>
struct PipeShape {
  static constexpr int LD = BK + 8;
  static constexpr int WM = BM == 16 ? 1 : 2;  // warps along the rows
  static constexpr int WN = 8 / WM;            // and along the columns
  static constexpr int FM = BM / 16 / WM;      // 16x16 fragments per warp
  static constexpr int FN = kPipeBN / 16 / WN;
  static constexpr size_t kStage = size_t(2 * BM + kPipeBN) * LD * 2;  // a hi, a lo, w (bytes)
  static constexpr size_t kOut = size_t(BM) * (kPipeBN + 4) * 4;
  static constexpr size_t kSmem = kStage * kPipeStages > kOut ? kStage * kPipeStages : kOut;
};

// a.A unused: the activations are ahi/alo [rows][K] (row m of output row m:
// arow[m] or m). Modes, gathering, scattering and grouping as gemm_kernel.
template <int BM, int BK>
__global__ void __launch_bounds__(kPipeThreads) gemm_pipe_kernel(GemmArgs a, const __nv_bfloat16* __restrict__ ahi,
                                                                 const __nv_bfloat16* __restrict__ alo) {
  using namespace nvcuda;
  using S = PipeShape<BM, BK>;
  constexpr int kPipeLd = S::LD, kPipeBK = BK, kRowChunks = BK / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  // Under PDL (a batched decode step) the kernel before has finished after
  // pdl_wait; a block that waits for its tile (a.tile_wait) skips it: the
  // kernel before is its tile's producer (which passed its own wait, so
  // the tile list is final), and the tile's count says when its rows are in.
  const bool tile_waits = a.tiles && a.tile_done && a.tile_wait > 0;
  if (!tile_waits) pdl_wait();
  pdl_trigger();
  int m0, m1;
  const __nv_bfloat16* W;
  if (a.tiles) {
    if (int(blockIdx.y) >= *a.ntiles) return;
    const int* tl = a.tiles + 3 * blockIdx.y;
    W = static_cast<const __nv_bfloat16*>(a.wtab[tl[0]]);
    m0 = tl[1];
    m1 = tl[2];
  } else {
    W = static_cast<const __nv_bfloat16*>(a.W);
    m0 = blockIdx.y * BM;
    m1 = min(a.M, m0 + BM);
  }
  constexpr int HB = kPipeBN / 2;
  const bool swiglu = a.mode == GEMM_SWIGLU;
  if (swiglu ? int(blockIdx.x) * HB >= a.half : int(blockIdx.x) * kPipeBN >= a.N) return;
  const int tid = threadIdx.x, warp = tid >> 5, wm = warp / S::WN, wn = warp % S::WN;
  if (tile_waits) {
    if (tid == 0) wait_count(a.tile_done + blockIdx.y, a.tile_wait);
    __syncthreads();
  }
  auto stage_a = [&](int s, int lohi) {
    return reinterpret_cast<__nv_bfloat16*>(smem + size_t(s) * S::kStage) + size_t(lohi) * BM * kPipeLd;
  };
  auto stage_w = [&](int s) {
    return reinterpret_cast<__nv_bfloat16*>(smem + size_t(s) * S::kStage) + size_t(2 * BM) * kPipeLd;
  };
  // 16-byte chunks per stage: A hi and lo (BM rows each), W (BN rows), BK / 8 per row.
  constexpr int kChunks = (2 * BM + kPipeBN) * kRowChunks;
  constexpr int kPer = (kChunks + kPipeThreads - 1) / kPipeThreads;
  const __nv_bfloat16* src[kPer];
  int dst_off[kPer];  // element offset inside a stage
  bool live[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int f = tid + u * kPipeThreads, row = f / kRowChunks, c = (f % kRowChunks) * 8;
    live[u] = f < kChunks;
    src[u] = nullptr;
    dst_off[u] = 0;
    if (!live[u]) continue;
    if (row < 2 * BM) {  // activations: hi rows, then lo rows
      const int r = row % BM, m = m0 + r;
      const __nv_bfloat16* base = row < BM ? ahi : alo;
      src[u] = m < m1 ? base + size_t(a.arow ? a.arow[m] : m) * a.K + c : nullptr;
      dst_off[u] = row * kPipeLd + c;
    } else {
      const int n = row - 2 * BM;
      int wr;
      bool ok;
      if (swiglu) {
        const int j = blockIdx.x * HB + (n % HB);
        ok = j < a.half;
        wr = n < HB ? j : a.half + j;
      } else {
        wr = blockIdx.x * kPipeBN + n;
        ok = wr < a.N;
      }
      src[u] = ok ? W + size_t(wr) * a.K + c : nullptr;
      dst_off[u] = row * kPipeLd + c;
    }
  }
  const int nk = (a.K + kPipeBK - 1) / kPipeBK;
  auto issue = [&](int kt) {
    if (kt < nk) {
      const int s = kt % kPipeStages, k0 = kt * kPipeBK;
      __nv_bfloat16* base = reinterpret_cast<__nv_bfloat16*>(smem + size_t(s) * S::kStage);
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        if (!live[u]) continue;
        const int c = dst_off[u] % kPipeLd;
        const bool ok = src[u] && k0 + c < a.K;
        cp_async16(base + dst_off[u], ok ? src[u] + k0 : (ahi ? ahi : alo), ok);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the counting uniform
  };
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[S::FM][S::FN];
#pragma unroll
  for (int i = 0; i < S::FM; ++i)
#pragma unroll
    for (int j = 0; j < S::FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
#pragma unroll
  for (int s = 0; s < kPipeStages - 1; ++s) issue(s);
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kPipeStages - 2>();
    __syncthreads();
    issue(kt + kPipeStages - 1);
    const int s = kt % kPipeStages;
    const __nv_bfloat16 *sh = stage_a(s, 0), *sl = stage_a(s, 1), *sw = stage_w(s);
#pragma unroll
    for (int kk = 0; kk < kPipeBK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[S::FN];
#pragma unroll
      for (int j = 0; j < S::FN; ++j)
        wmma::load_matrix_sync(b[j], sw + size_t((wn * S::FN + j) * 16) * kPipeLd + kk, kPipeLd);
#pragma unroll
      for (int i = 0; i < S::FM; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> ah, al;
        const size_t ro = size_t((wm * S::FM + i) * 16) * kPipeLd + kk;
        wmma::load_matrix_sync(ah, sh + ro, kPipeLd);
        wmma::load_matrix_sync(al, sl + ro, kPipeLd);
#pragma unroll
        for (int j = 0; j < S::FN; ++j) {
          wmma::mma_sync(acc[i][j], al, b[j], acc[i][j]);
          wmma::mma_sync(acc[i][j], ah, b[j], acc[i][j]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  constexpr int kCLd = kPipeBN + 4;
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < S::FM; ++i)
#pragma unroll
    for (int j = 0; j < S::FN; ++j)
      wmma::store_matrix_sync(cs + size_t((wm * S::FM + i) * 16) * kCLd + (wn * S::FN + j) * 16, acc[i][j], kCLd,
                              wmma::mem_row_major);
  __syncthreads();
  gemm_epilogue<BM, kPipeBN, kPipeThreads>(a, cs, kCLd, m0, m1 - m0);
  if (a.tiles && a.tile_done && a.tile_wait == 0) {  // this block's share of the tile is stored
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(a.tile_done + blockIdx.y, 1);
  }
}

}  // namespace flashmoe::cuda
