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
  const int bi = block_argmax(logits, V);
  if (threadIdx.x < 32) {
    const int l = threadIdx.x;
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
