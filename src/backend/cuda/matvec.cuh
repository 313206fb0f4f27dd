// Matrix-vector products of the decode step: y (+)= W . norm(x), weight
// rows streamed with several rows' loads in flight per warp.
#pragma once
#include "backend/cuda/common.cuh"

namespace flashmoe::cuda {

// The first n rows this warp will process in a row kernel (grid-stride over
// blocks of rpb rows, `split` warps per row): prefetched into L2 before the
// kernel waits on its predecessor (PDL), so the weight stream overlaps the
// previous kernel's tail instead of starting after it. The host picks n so
// that what all warps prefetch fits in half the L2.
template <typename T>
__device__ __forceinline__ void prefetch_rows(const T* W, int rows, int cols, int split, int n) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = kWarps / split, sub = warp % split, lr = warp / split, chunk = cols / split;
  for (int r = blockIdx.x * rpb + lr, i = 0; r < rows && i < n; r += gridDim.x * rpb, ++i)
    warp_prefetch(W + size_t(r) * cols + sub * chunk, size_t(chunk) * sizeof(T), lane);
}

// y[r] (+)= W[r,:] . xs for the rows of this block. `split` warps share a
// row (each a slice of the columns; partials summed in a fixed order),
// kWarps/split rows per block, blocks loop over rows (grid-stride), `per`
// rows per warp at a time (2, or 3 for a matrix that needs three rows per
// warp: one batch of loads instead of two). Several rows' loads in flight
// per warp shorten the chain of dependent load rounds; splitting keeps
// enough loads in flight for matrices of few rows.
template <typename T>
__device__ __forceinline__ void matvec_rows(const T* __restrict__ W, int rows, int cols, const float* xs,
                                            float* __restrict__ y, int accumulate, int split, int per,
                                            int bid, int nb) {  // this block's index among the nb doing W
  __shared__ float part[3][kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = kWarps / split, sub = warp % split, lr = warp / split, chunk = cols / split;
  const int stride = nb * rpb;
  for (int r0 = bid * rpb; r0 < rows; r0 += per * stride) {
    const int r = r0 + lr;
    int n = 0;
    while (n < per && r + n * stride < rows) ++n;
    float acc[3] = {0.f, 0.f, 0.f};
    const T* w = W + size_t(r) * cols + sub * chunk;
    if (n == 3) rows_dot<T, 3>(w, size_t(stride) * cols, 3, xs + sub * chunk, chunk, lane, acc);
    else if (n == 2) rows_dot<T, 2>(w, size_t(stride) * cols, 2, xs + sub * chunk, chunk, lane, acc);
    else if (n == 1) acc[0] = row_dot<T>(w, xs + sub * chunk, chunk, lane);
#pragma unroll
    for (int i = 0; i < 3; ++i) acc[i] = warp_sum(acc[i]);
    if (split == 1) {
      if (lane == 0)
        for (int i = 0; i < n; ++i) {
          const int ri = r + i * stride;
          y[ri] = accumulate ? y[ri] + acc[i] : acc[i];
        }
      continue;
    }
    if (lane == 0) part[0][warp] = acc[0], part[1][warp] = acc[1], part[2][warp] = acc[2];
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

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null).
// per: rows per warp at a time (matvec_rows).
template <typename T>
__global__ void __launch_bounds__(kThreads, 4) matvec_kernel(const T* __restrict__ W, int rows, int cols,
                                                          const float* __restrict__ x, const float* __restrict__ nw,
                                                          float eps, float* __restrict__ y, int accumulate, int split,
                                                          int pf_rows, int per, float* __restrict__ xcopy) {
  extern __shared__ __align__(16) float xs[];
  prefetch_rows(W, rows, cols, split, pf_rows);
  NormPre pre;
  norm_preload(nw, cols, true, pre);
  pdl_wait();
  pdl_trigger();
  // The layer's input residual, kept for the folded router (outproj_router_kernel).
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  if (!nw) {
    // No norm: each warp reads its slice of x straight from L1/L2 alongside
    // the weights, instead of the block staging all of x first.
    matvec_rows(W, rows, cols, x, y, accumulate, split, per, blockIdx.x, gridDim.x);
    return;
  }
  load_x(x, nw, eps, cols, xs, &pre);
  matvec_rows(W, rows, cols, xs, y, accumulate, split, per, blockIdx.x, gridDim.x);
}

}  // namespace flashmoe::cuda
