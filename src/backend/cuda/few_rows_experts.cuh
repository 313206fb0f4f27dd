// The routed experts of a batched step when each picked expert has only a
// few of the step's rows (continuous batching: B tokens x top-k spread over
// E experts, about B * k / E rows per picked expert). The tiled product
// (gemm.cuh) pads each expert's rows to a 16-row tile: at 1-2 rows it does
// 8-16x the arithmetic and its weight loads wait on the tensor cores. Here
// each block takes one tile of route_lists_kernel's list (one expert, up to
// kFewRows of its rows), holds those rows' activations in shared memory,
// and its warps stream the expert's weight rows once, as the decode step's
// expert kernels do (experts.cuh), each 16-byte load dotted with every row
// held. fp32 accumulation of exact weights: the decode step's arithmetic.
// bf16 / f16 / f32 weights; quantised experts keep the tiled product.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/common.cuh"

namespace flashmoe::cuda {

constexpr int kFewRows = 4;   // rows per tile: route_lists_kernel's BM for this kernel
constexpr int kFewWarps = 8;  // warps per block

struct FewRowsArgs {
  const float* A = nullptr;  // activations [rows][lda] fp32
  int lda = 0;
  const int* arow = nullptr;         // A row of list entry p (null: p)
  const void* const* wtab = nullptr;  // expert e's weights [rows][K] (swiglu: N gate rows, then N up rows)
  const int* tiles = nullptr;         // [tile][3] = {expert, first entry, end entry}
  const int* ntiles = nullptr;        // how many tiles (blocks beyond return)
  int K = 0;                          // columns of the weights and of A's rows used
  int N = 0;                          // output columns (swiglu: the gate rows)
  float* C = nullptr;                 // [rows][ldc]
  int ldc = 0;
  const int* crow = nullptr;  // C row of list entry p (null: p)
  int swiglu = 0;             // C = silu(gate . a) * (up . a), else C = W . a
};

// Weight rows per warp at a time: swiglu two columns (gate and up of each),
// else four rows; the loads of all of them in flight together.
constexpr int kFewRowsPerWarp = 4;

// The 16 bytes w as V = 16 / sizeof(T) floats.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& w, float* f) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      f[i] = __uint_as_float(u[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(u[i] << 16);
      f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    } else {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      f[2 * i] = h.x;
      f[2 * i + 1] = h.y;
    }
  }
}

// acc[s] += w . xs[s][c..c+V) for the n <= kFewRows rows held (w unpacked once).
template <typename T>
__device__ __forceinline__ void dot_rows(const uint4& w, const float* xs, int K, int c, int n, float* acc) {
  constexpr int V = 16 / sizeof(T);
  float f[V];
  unpack16<T>(w, f);
#pragma unroll
  for (int s = 0; s < kFewRows; ++s)
    if (s < n) {
      const float* x = xs + s * K + c;
      float t = 0.f;
#pragma unroll
      for (int q = 0; q < V; q += 4) {
        const float4 v = *reinterpret_cast<const float4*>(x + q);
        t += f[q] * v.x + f[q + 1] * v.y + f[q + 2] * v.z + f[q + 3] * v.w;
      }
      acc[s] += t;
    }
}

template <typename T>
__global__ void __launch_bounds__(kFewWarps * 32) few_rows_kernel(FewRowsArgs a) {
  extern __shared__ __align__(16) float xs[];  // [n][K]
  const int t = blockIdx.y;
  if (t >= *a.ntiles) return;
  const int e = a.tiles[3 * t], p0 = a.tiles[3 * t + 1], n = a.tiles[3 * t + 2] - p0;
  const int K = a.K;
  for (int i = 0; i < n; ++i) {
    const int r = a.arow ? a.arow[p0 + i] : p0 + i;
    const float4* src = reinterpret_cast<const float4*>(a.A + size_t(r) * a.lda);
    float4* dst = reinterpret_cast<float4*>(xs + size_t(i) * K);
    for (int c = threadIdx.x; c < K / 4; c += blockDim.x) dst[c] = src[c];
  }
  __syncthreads();
  const T* W = static_cast<const T*>(a.wtab[e]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int R = kFewRowsPerWarp, V = 16 / sizeof(T);
  const int cols = a.swiglu ? R / 2 : R;  // output columns per warp step
  for (int j0 = (blockIdx.x * kFewWarps + warp) * cols; j0 < a.N; j0 += gridDim.x * kFewWarps * cols) {
    // Weight row of slot i: swiglu gate rows j0, j0+1 at slots 0, 1 and
    // their up rows at 2, 3; else rows j0..j0+3.
    const T* w[R];
    bool ok[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int col = a.swiglu ? j0 + (i % (R / 2)) : j0 + i;
      const int row = a.swiglu && i >= R / 2 ? a.N + col : col;
      ok[i] = col < a.N;
      w[i] = W + size_t(ok[i] ? row : 0) * K;
    }
    float acc[R][kFewRows];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int s = 0; s < kFewRows; ++s) acc[i][s] = 0.f;
    int c = lane * V;
    // Two column steps per iteration: 2R loads in flight per lane.
    for (; c + 32 * V < K; c += 64 * V) {
      uint4 p[R], q[R];
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (ok[i]) {
          p[i] = ld_stream(w[i] + c);
          q[i] = ld_stream(w[i] + c + 32 * V);
        }
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (ok[i]) {
          dot_rows<T>(p[i], xs, K, c, n, acc[i]);
          dot_rows<T>(q[i], xs, K, c + 32 * V, n, acc[i]);
        }
    }
    if (c < K) {
      uint4 p[R];
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (ok[i]) p[i] = ld_stream(w[i] + c);
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (ok[i]) dot_rows<T>(p[i], xs, K, c, n, acc[i]);
    }
#pragma unroll
    for (int s = 0; s < kFewRows; ++s) {
      if (s >= n) break;
      float v[R];
#pragma unroll
      for (int i = 0; i < R; ++i) v[i] = warp_sum(acc[i][s]);
      if (lane == 0) {
        const int p = p0 + s;
        float* out = a.C + size_t(a.crow ? a.crow[p] : p) * a.ldc;
        if (a.swiglu) {
#pragma unroll
          for (int i = 0; i < R / 2; ++i)
            if (ok[i]) out[j0 + i] = siluf_(v[i]) * v[R / 2 + i];
        } else {
#pragma unroll
          for (int i = 0; i < R; ++i)
            if (ok[i]) out[j0 + i] = v[i];
        }
      }
    }
  }
}

// Shared memory of a few_rows_kernel block over K columns.
inline size_t few_rows_smem(int K) { return size_t(kFewRows) * size_t(K) * sizeof(float); }

// Whether few_rows_kernel takes experts stored as dt (DT_F32 / DT_F16 /
// DT_BF16, device_model.cuh) with K columns (a multiple of the 16-byte
// vector, its rows in shared memory).
inline bool few_rows_supported(int dt, int K, int max_smem) {
  if (dt != 0 && dt != 1 && dt != 2) return false;
  const int V = dt == 0 ? 4 : 8;
  return K % V == 0 && few_rows_smem(K) <= size_t(max_smem);
}

// Launches few_rows_kernel for weights of type dt (few_rows_supported) over
// up to max_tiles tiles. The grid spreads each expert's output columns over
// enough blocks that every warp takes about four steps.
inline cudaError_t launch_few_rows(int dt, const FewRowsArgs& a, int max_tiles, cudaStream_t st) {
  const int cols = a.swiglu ? kFewRowsPerWarp / 2 : kFewRowsPerWarp;
  const int per_block = kFewWarps * cols * 4;
  const dim3 grid(unsigned((a.N + per_block - 1) / per_block), unsigned(max_tiles > 0 ? max_tiles : 1));
  const size_t smem = few_rows_smem(a.K);
  auto go = [&](auto kern) {
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      if (e != cudaSuccess) return e;
    }
    kern<<<grid, kFewWarps * 32, smem, st>>>(a);
    return cudaGetLastError();
  };
  if (dt == 0) return go(few_rows_kernel<float>);
  if (dt == 1) return go(few_rows_kernel<__half>);
  return go(few_rows_kernel<__nv_bfloat16>);
}

}  // namespace flashmoe::cuda
