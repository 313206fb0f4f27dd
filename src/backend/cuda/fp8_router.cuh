// The MoE router folded into an FP8 output projection's launch (as
// outproj_router_kernel, router.cuh, for float projections): the fold
// R = [ Wr (1 + w) | Wr (1 + w) W_out ] made from the dequantised W_out
// (codes times block scales, in double, once at upload), the projection on
// the tensor cores (f8_matvec_tiles, fp8_matvec.cuh).
#pragma once
#include "backend/cuda/fp8_matvec.cuh"
#include "backend/cuda/router.cuh"

namespace flashmoe::cuda {

// fold_router_kernel for an FP8 W_out [H][O] (codes, per-row block scales S
// of `group` columns each).
template <typename T>
__global__ void fold_router_fp8_kernel(const T* __restrict__ Wr, int rows, const float* __restrict__ w,
                                       const uint8_t* __restrict__ Wout, const float* __restrict__ S, int group,
                                       int H, int O, float* __restrict__ R) {
  const int e = blockIdx.y, nbc = (O + group - 1) / group;
  const T* wr = Wr + size_t(e) * H;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < H + O; c += gridDim.x * blockDim.x) {
    double v = 0.0;
    if (c < H) {
      v = double(to_f<T>(wr[c])) * (1.0 + double(w[c]));
    } else {
      const int o = c - H;
      for (int h = 0; h < H; ++h) {
        const __half_raw q = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(Wout[size_t(h) * O + o]), __NV_E4M3);
        const double wo = double(__half2float(__half(q))) * double(S[size_t(h) * nbc + o / group]);
        v += double(to_f<T>(wr[h])) * (1.0 + double(w[h])) * wo;
      }
    }
    R[size_t(e) * (H + O) + c] = float(v);
  }
}

// Its dynamic shared memory: o split for the mma, then the warps' slots.
inline size_t f8_outproj_smem(int O) { return (f8_split_bytes(O) + 15) / 16 * 16 + f8_warp_bufs(kWarps); }

// Blocks [0, nbA): x += W_out . o for an FP8 W_out [H][O] (block width a multiple of 64),
// o = cat + H split into shared memory (f8_outproj_smem) by each block; the
// others the folded router (as outproj_router_kernel's). The projection's
// blocks come first: where the slots make fewer blocks resident than the
// grid has, the router's short blocks wait for a slot, not the projection.
// splitA: warps per tile (f8_mma_split).
static __global__ void __launch_bounds__(kThreads, 3)
    outproj_router_fp8_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S, int group, OutRouterArgs a) {
  extern __shared__ __align__(16) __half os[];
  uint4* buf = f8_warp_buf(reinterpret_cast<char*>(os) + (f8_split_bytes(a.O) + 15) / 16 * 16);
  const int bid = int(blockIdx.x);
  F8Batch first;
  bool have_first = false;
  if (bid < a.nbA) {
    have_first = f8_matvec_first(W, S, group, a.H, a.O, a.splitA, bid, first, buf);
  }
  if (a.sel.out && bid == a.nbA && threadIdx.x < 32) prefetch_tables(a.sel, a.E);
  pdl_wait();
  pdl_trigger();
  if (bid >= a.nbA) {  // outproj_router_kernel's router blocks
    router_block(a, bid - a.nbA);
    return;
  }
  const F8Split X = f8_split_block(a.cat + a.H, a.O, os);
  f8_matvec_tiles(W, S, group, a.H, a.O, X, a.x, 1, a.splitA, bid, a.nbA, first, have_first, buf);
}

}  // namespace flashmoe::cuda
