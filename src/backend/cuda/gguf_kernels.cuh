// The decode step's kernels for weights in GGUF block formats (GMat,
// gguf_blocks.cuh): the matrix-vector product, the embedding row, and the
// routed experts (each expert's gate/up and down blocks as the file stores
// them). A lane takes 8 columns at a time: it reads the bytes of those 8
// weights and their block's scales, expands them in registers and
// multiplies with x staged in shared memory. The kind of a row is looked up
// per row (a uniform branch: all lanes of a warp share the row).
#pragma once
#include "backend/cuda/experts.cuh"
#include "backend/cuda/gguf_blocks.cuh"

namespace flashmoe::cuda {

// One warp's partial dot of a GGUF row (cols columns, kind k) with xs.
__device__ __forceinline__ float grow_dot(int k, const uint8_t* row, const float* xs, int cols, int lane) {
  float acc = 0.f;
  for (int c = lane * 8; c < cols; c += 32 * 8) {
    float w[8];
    gguf_weights8(k, row, c, w);
    const float4 a = *reinterpret_cast<const float4*>(xs + c), b = *reinterpret_cast<const float4*>(xs + c + 4);
    acc += ((w[0] * a.x + w[1] * a.y) + (w[2] * a.z + w[3] * a.w)) + ((w[4] * b.x + w[5] * b.y) + (w[6] * b.z + w[7] * b.w));
  }
  return acc;
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
    const float d = warp_sum(grow_dot(k, row, xs, cols, lane));
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
  for (int r = blockIdx.x * kWarps + warp; r < I; r += gridDim.x * kWarps) {
    int kg, ku;
    const uint8_t* gr = gmat_row(g, B, a.H, r, kg);
    const uint8_t* ur = gmat_row(g, B, a.H, I + r, ku);
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
  // The routed slots' pieces (k * I / 8 of them) spread over the lanes
  // together (an expert row of few columns would leave lanes idle), then the
  // shared expert's row.
  const int P = a.I / 8, n = k * P;
  for (int r = blockIdx.x * kWarps + warp; r < a.H; r += gridDim.x * kWarps) {
    float acc = 0.f;
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
      acc += wj[k] * grow_dot(kd, row, a.hb + k * a.maxI, a.Is, lane);
    }
    acc = warp_sum(acc);
    if (lane == 0) a.x[r] += acc;
  }
}

}  // namespace flashmoe::cuda
