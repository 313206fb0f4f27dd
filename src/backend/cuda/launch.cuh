// The decode step's launch machinery: every kernel goes out through
// cudaLaunchKernelEx with programmatic dependent launch (PDL: a kernel may
// start while the one before it drains, and waits for it in pdl_wait()),
// clusters where a kernel asks for them, and grids sized to one resident
// wave by an occupancy query.
//
// Header-only on purpose: a kernel's function pointer names the instance of
// the translation unit that takes it, so the occupancy queries and launches
// must run in the unit that launches (decode_step.cu).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.cuh"

namespace flashmoe::cuda {

// Resident blocks per SM the row kernels' grids are sized for: 4 leaves room
// for the next kernel's blocks to become resident early under PDL; 8 was
// slower, 2-3 ran short of loads in flight (v6 in bench/NOTES-cuda.md).
constexpr int kBlocksPerSm = 4;

struct Launcher {
  cudaStream_t stream = nullptr;
  cudaDeviceProp prop{};
  // PDL on every launch but a step's first (the operation before it in the
  // stream is then a copy, a graph boundary or another step's end).
  bool pdl_next = false;
  int cluster_next = 1;  // blocks per cluster of the next go() (then back to 1)

  template <typename... K, typename... A>
  void go(void (*kern)(K...), dim3 grid, dim3 block, size_t smem, A... args) {
    const int cl = cluster_next;
    cluster_next = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[2];
    int n = 0;
    if (pdl_next) {
      at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      at[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cl > 1) {
      at[n].id = cudaLaunchAttributeClusterDimension;
      at[n++].val.clusterDim = {unsigned(cl), 1, 1};
    }
    cfg.attrs = at;
    cfg.numAttrs = n;
    check(cudaLaunchKernelEx(&cfg, kern, args...), "cudaLaunchKernelEx");
    pdl_next = true;
  }

  // Warps per row: enough warps in flight for matrices of few rows.
  int split_for(int rows, int cols, int vec) const {
    const int target = prop.multiProcessorCount * 48;
    int s = 1;
    while (s < kWarps && rows * s < target && cols % (2 * s * vec) == 0) s *= 2;
    return s;
  }

  // Rows per warp to prefetch before a row kernel's wait: all of them when
  // the whole matrix fits in half the L2, else as many as do (at least one).
  int pf_rows(size_t bytes, int rows, int blocks, int rpb) const {
    const int per_warp = (rows + blocks * rpb - 1) / (blocks * rpb);
    const size_t half = size_t(prop.l2CacheSize) / 2, row = bytes / size_t(std::max(rows, 1));
    const size_t fit = half / std::max<size_t>(1, row * size_t(blocks) * rpb);
    return int(std::clamp<size_t>(fit, 1, size_t(per_warp)));
  }

  // Blocks per SM for a row kernel: kBlocksPerSm, or fewer when that many do
  // not fit (registers, shared memory), so the grid is one resident wave.
  struct Fit {
    const void* func;
    size_t smem;
    int threads, n;
  };
  std::vector<Fit> fit_cache;
  int per_sm(const void* func, size_t smem, int threads = kThreads) {
    for (const Fit& f : fit_cache)
      if (f.func == func && f.smem == smem && f.threads == threads) return f.n;
    int n = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, func, threads, smem));
    n = std::clamp(n, 1, kBlocksPerSm);
    fit_cache.push_back({func, smem, threads, n});
    return n;
  }
};

}  // namespace flashmoe::cuda
