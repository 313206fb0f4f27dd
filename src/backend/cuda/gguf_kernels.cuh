// The decode step's kernels for weights in GGUF block formats (GMat,
// gguf_blocks.cuh): the matrix-vector product, the embedding row, and the
// routed experts (each expert's gate/up and down blocks as the file stores
// them). A warp takes a row: Q4_K / Q6_K rows a whole block per warp
// iteration with coalesced loads (gguf_warp_dot.cuh), the other kinds 8
// columns a lane. The kind of a row is looked up per row (a uniform branch:
// all lanes of a warp share the row).
#pragma once
#include "backend/cuda/experts.cuh"
#include "backend/cuda/gguf_blocks.cuh"
#include "backend/cuda/gguf_warp_dot.cuh"

namespace flashmoe::cuda {

// Whether every part of g is of a kind read a block per warp iteration
// (Q4_K, Q6_K); the expert kernels then give each row's blocks to the whole
// warp instead of spreading 8-column pieces of several rows over the lanes.
__device__ __forceinline__ bool gmat_blockwise(const GMat& g) {
  for (int i = 0; i < g.n; ++i)
    if (g.kind[i] != GQ_Q4_K && g.kind[i] != GQ_Q6_K) return false;
  return g.n > 0;
}

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null): one warp per
// row, grid-stride; x (normed) staged in shared memory.
static __global__ void __launch_bounds__(kThreads) gmatvec_kernel(const void* __restrict__ W, GMat g, int rows,
                                                                  int cols, const float* __restrict__ x,
                                                                  const float* __restrict__ nw, float eps,
                                                                  float* __restrict__ y, int accumulate,
                                                                  float* __restrict__ xcopy) {
  extern __shared__ __align__(16) float xs[];
  pdl_wait();
  pdl_trigger();
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  load_x(x, nw, eps, cols, xs);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = blockIdx.x * kWarps + warp; r < rows; r += gridDim.x * kWarps) {
    int k;
    const uint8_t* row = gmat_row(g, W, cols, r, k);
    const float d = warp_sum(gguf_lane_row_dot(k, row, xs, cols, lane));
    if (lane == 0) y[r] = accumulate ? y[r] + d : d;
  }
}

// x = embed[token] for a GGUF embedding (decode: the token from the ids ring).
static __global__ void gembed_kernel(const void* __restrict__ E, GMat g, int H, const int* __restrict__ ids,
                                     const int* __restrict__ pos, const int* __restrict__ base, int ring,
                                     float* __restrict__ x) {
  pdl_wait();
  pdl_trigger();
  const int tok = ids[(*pos - *base) % ring];
  int k;
  const uint8_t* row = gmat_row(g, E, H, tok, k);
  for (int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8; c < H; c += gridDim.x * blockDim.x * 8) {
    float w[8];
    gguf_weights8(k, row, c, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[c + i] = w[i];
  }
}

// x[t] = embed[ids[t]] for the T rows of a prefill chunk (one block per row).
static __global__ void gembed_rows_kernel(const void* __restrict__ E, GMat g, int H, const int* __restrict__ ids,
                                          float* __restrict__ x) {
  const int t = blockIdx.x;
  int k;
  const uint8_t* row = gmat_row(g, E, H, ids[t], k);
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float w[8];
    gguf_weights8(k, row, c, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[size_t(t) * H + c + i] = w[i];
  }
}

// The routed experts' and the shared expert's (or dense MLP's) layouts.
struct GExperts {
  GMat gu, dn;  // a routed expert's gate/up block (gate rows, then up rows at row I) and down block
  GMat sgu, sdn;  // the shared expert / dense MLP (bases a.s_gu, a.s_down)
};

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j (j
// == k: the shared expert). The experts were picked before (top-k kernel).
static __global__ void __launch_bounds__(kThreads) ggate_up_kernel(MoeArgs a, GExperts ge) {
  extern __shared__ __align__(16) float xs[];
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  pdl_wait();
  pdl_trigger();
  load_x(a.x, a.norm_w, a.eps, a.H, xs);
  const void* B = shared ? a.s_gu : (a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
  const GMat& g = shared ? ge.sgu : ge.gu;
  const int P = a.H / 8;  // 8-column pieces per row
  const bool blockwise = gmat_blockwise(g);
  for (int r = blockIdx.x * kWarps + warp; r < I; r += gridDim.x * kWarps) {
    int kg, ku;
    const uint8_t* gr = gmat_row(g, B, a.H, r, kg);
    const uint8_t* ur = gmat_row(g, B, a.H, I + r, ku);
    if (blockwise) {
      const float gv = warp_sum(gguf_lane_row_dot(kg, gr, xs, a.H, lane));
      const float uv = warp_sum(gguf_lane_row_dot(ku, ur, xs, a.H, lane));
      if (lane == 0) a.hb[j * a.maxI + r] = siluf_(gv) * uv;
      continue;
    }
    // The gate row's pieces then the up row's, spread over the lanes together.
    float gv = 0.f, uv = 0.f;
    for (int idx = lane; idx < 2 * P; idx += 32) {
      const bool up = idx >= P;
      const int c = (up ? idx - P : idx) * 8;
      float w[8];
      gguf_weights8(up ? ku : kg, up ? ur : gr, c, w);
      const float4 x0 = *reinterpret_cast<const float4*>(xs + c), x1 = *reinterpret_cast<const float4*>(xs + c + 4);
      const float d = ((w[0] * x0.x + w[1] * x0.y) + (w[2] * x0.z + w[3] * x0.w)) +
                      ((w[4] * x1.x + w[5] * x1.y) + (w[6] * x1.z + w[7] * x1.w));
      if (up) uv += d;
      else gv += d;
    }
    gv = warp_sum(gv);
    uv = warp_sum(uv);
    if (lane == 0) a.hb[j * a.maxI + r] = siluf_(gv) * uv;
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j (the shared expert's slot k last),
// one warp per row; h read from global memory (small, stays in L1/L2).
static __global__ void __launch_bounds__(kThreads) gdown_kernel(MoeArgs a, GExperts ge) {
  __shared__ const void* ptr[33];
  __shared__ float wj[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k = a.k;
  pdl_wait();
  pdl_trigger();
  if (int(threadIdx.x) < k) ptr[threadIdx.x] = a.sel ? a.sel[k + threadIdx.x] : a.down_tab[a.ids[threadIdx.x]];
  if (int(threadIdx.x) == k && a.has_shared) ptr[k] = a.s_down;
  if (int(threadIdx.x) < k + (a.has_shared ? 1 : 0)) wj[threadIdx.x] = a.w[threadIdx.x];
  __syncthreads();
  // Q4_K / Q6_K: each routed slot's row a block per warp iteration.
  // Otherwise the routed slots' pieces (k * I / 8 of them) spread over the
  // lanes together (an expert row of few columns would leave lanes idle).
  // Then the shared expert's row.
  const int P = a.I / 8, n = k * P;
  const bool blockwise = gmat_blockwise(ge.dn);
  for (int r = blockIdx.x * kWarps + warp; r < a.H; r += gridDim.x * kWarps) {
    float acc = 0.f;
    if (blockwise)
      for (int s = 0; s < k; ++s) {
        int kd;
        const uint8_t* row = gmat_row(ge.dn, ptr[s], a.I, r, kd);
        acc += wj[s] * gguf_lane_row_dot(kd, row, a.hb + s * a.maxI, a.I, lane);
      }
    else
      for (int idx = lane; idx < n; idx += 32) {
        const int s = idx / P, c = (idx - s * P) * 8;
        int kd;
        const uint8_t* row = gmat_row(ge.dn, ptr[s], a.I, r, kd);
        float w[8];
        gguf_weights8(kd, row, c, w);
        const float* h = a.hb + s * a.maxI + c;
        const float4 x0 = *reinterpret_cast<const float4*>(h), x1 = *reinterpret_cast<const float4*>(h + 4);
        acc += wj[s] * (((w[0] * x0.x + w[1] * x0.y) + (w[2] * x0.z + w[3] * x0.w)) +
                        ((w[4] * x1.x + w[5] * x1.y) + (w[6] * x1.z + w[7] * x1.w)));
      }
    if (a.has_shared) {
      int kd;
      const uint8_t* row = gmat_row(ge.sdn, ptr[k], a.Is, r, kd);
      acc += wj[k] * gguf_lane_row_dot(kd, row, a.hb + k * a.maxI, a.Is, lane);
    }
    acc = warp_sum(acc);
    if (lane == 0) a.x[r] += acc;
  }
}

}  // namespace flashmoe::cuda
