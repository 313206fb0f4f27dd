// The decode step's first and last kernels: the token's embedding row,
// the greedy argmax over the logits, the position counters.
#pragma once
#include "backend/cuda/common.cuh"

namespace flashmoe::cuda {

// x = embed[token]
template <typename T>
__global__ void embed_kernel(const T* __restrict__ E, int H, const int* __restrict__ ids, const int* __restrict__ pos,
                             const int* __restrict__ base, int ring, float* __restrict__ x) {
  pdl_wait();
  pdl_trigger();
  const int tok = ids[(*pos - *base) % ring];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < H; i += gridDim.x * blockDim.x)
    x[i] = to_f<T>(E[size_t(tok) * H + i]);
}

// Greedy: argmax of logits (ties: lower index) -> ids ring at pos+1, out[step].
// The chosen token's embedding row goes into L2 for the next step's embed
// kernel (erow bytes per row at E; null: not done).
static __global__ void argmax_kernel(const float* __restrict__ logits, int V, int* ids, const int* pos, const int* base,
                              int ring, int* out, const int* step, const char* E, size_t erow) {
  pdl_wait();
  pdl_trigger();
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  auto take = [&](float v, int i) {
    if (v > bv) {
      bv = v;
      bi = i;
    }
  };
  // 16-byte loads, eight in flight per thread (one thread per element was
  // a chain of V / blockDim dependent rounds); indices still rise per thread.
  const int V4 = (reinterpret_cast<uintptr_t>(logits) % 16 == 0) ? V / 4 : 0;
  const float4* l4 = reinterpret_cast<const float4*>(logits);
#pragma unroll 8
  for (int i = threadIdx.x; i < V4; i += blockDim.x) {
    const float4 v = l4[i];
    take(v.x, 4 * i);
    take(v.y, 4 * i + 1);
    take(v.z, 4 * i + 2);
    take(v.w, 4 * i + 3);
  }
  for (int i = 4 * V4 + threadIdx.x; i < V; i += blockDim.x) take(logits[i], i);
  __shared__ float sv[32];
  __shared__ int si[32];
  warp_argmax(bv, bi);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) {
    sv[w] = bv;
    si[w] = bi;
  }
  __syncthreads();
  if (w == 0) {
    const int nw = blockDim.x >> 5;
    bv = l < nw ? sv[l] : -INFINITY;
    bi = l < nw ? si[l] : 0x7fffffff;
    warp_argmax(bv, bi);
    if (bi == 0x7fffffff) bi = 0;  // all NaN: still a valid id
    if (l == 0) {
      ids[(*pos + 1 - *base) % ring] = bi;
      out[*step] = bi;
    }
    if (E) warp_prefetch(E + size_t(bi) * erow, erow, l);
  }
}

// End of a step: position and step counters advance.
static __global__ void advance_kernel(int* pos, int* step) {
  pdl_wait();
  *pos += 1;
  *step += 1;
}

}  // namespace flashmoe::cuda
