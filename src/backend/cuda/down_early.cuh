// The down projection with its weights loaded before the PDL wait (v14 in
// bench/NOTES-cuda.md). down_slots_kernel issues
// its one round of loads after gate_up has completed; but which experts'
// rows it reads was decided two kernels back (the pick in the output
// projection's launch, or the router / top-k kernel), so those rows can be
// in registers while gate_up still runs: down's first DRAM latency leaves
// the chain. Only h (gate_up's output) and the weights w wait.
#pragma once
#include "backend/cuda/experts.cuh"

namespace flashmoe::cuda {

// As down_slots_kernel: R consecutive rows per block, one warp per slot; CH
// 16-byte chunks per lane and row (I <= 32 * CH * 16 / sizeof(T)).
// early: the pick is final before the wait (not made by gate_up itself).
template <typename T, int R, int CH>
__global__ void __maxnreg__(112) down_early_kernel(MoeArgs a, int early) {
  constexpr int V = 16 / int(sizeof(T));
  __shared__ float part[kDownSlotsMax][R];
  const int j = threadIdx.x >> 5, lane = threadIdx.x & 31, slots = blockDim.x >> 5;
  const int r0 = blockIdx.x * R, n = min(R, a.H - r0);
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  uint4 w[R][CH];
  auto load = [&] {
    const T* W = shared ? static_cast<const T*>(a.s_down)
                        : static_cast<const T*>(a.sel ? a.sel[a.k + j] : a.down_tab[a.ids[j]]);
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int col = (c * 32 + lane) * V;
        w[i][c] = i < n && col < I ? ld_stream(W + size_t(r0 + i) * I + col) : make_uint4(0, 0, 0, 0);
      }
  };
  if (early) load();
  pdl_wait();
  pdl_trigger();
  if (!early) load();
  const float* h = a.hb + j * a.maxI;
  float d[R];
#pragma unroll
  for (int i = 0; i < R; ++i) d[i] = 0.f;
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int col = (c * 32 + lane) * V;
    if (col < I)
#pragma unroll
      for (int i = 0; i < R; ++i) d[i] += dot16<T>(w[i][c], h + col);
  }
  down_slots_sum<R>(d, a.w[j], part, j, lane, slots, n, a.x + r0);
}

}  // namespace flashmoe::cuda
