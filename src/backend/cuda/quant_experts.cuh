// The routed experts' products for q8/q4 experts (packed models: group-wise
// affine quantisation, w = q * scale + bias per group of columns, the MLX
// layout of core/matrix.h; device blocks as QExpert in device_model.cuh).
// A group's dot is scale * (q . x) + bias * sum(x), so the codes are never
// widened to weights: 8 columns at a time, codes and x in registers. The
// shared expert (slot k) keeps its own storage type TS. Decode only: these
// kernels take the ids the top-k kernel wrote (no top-k inside gate_up).
#pragma once
#include "backend/cuda/device_model.cuh"
#include "backend/cuda/kernels.cuh"

namespace flashmoe::cuda {

// One warp's partial dot of a quantised row (cols a multiple of 128 / BITS:
// whole 16-byte chunks) with x; sc, bi: the row's bf16 scales and biases.
template <int BITS>
__device__ __forceinline__ float qrow_dot(const uint8_t* __restrict__ w, const __nv_bfloat16* __restrict__ sc,
                                          const __nv_bfloat16* __restrict__ bi, int group, const float* x, int cols,
                                          int lane) {
  constexpr int EPC = 128 / BITS;  // columns per 16-byte chunk: 16 (q8), 32 (q4)
  float acc = 0.f;
#pragma unroll 2
  for (int c = lane * EPC; c < cols; c += 32 * EPC) {
    const uint4 v = ld_stream(w + c * BITS / 8);
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int s = 0; s < EPC / 8; ++s) {
      const int c8 = c + 8 * s;
      const float4 x0 = *reinterpret_cast<const float4*>(x + c8), x1 = *reinterpret_cast<const float4*>(x + c8 + 4);
      const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      float d = 0.f, xsum = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        uint32_t q;
        if constexpr (BITS == 8) q = (u[2 * s + i / 4] >> (8 * (i % 4))) & 0xffu;
        else q = (u[s] >> (4 * i)) & 0xfu;  // lowest nibble first
        d += float(q) * xv[i];
        xsum += xv[i];
      }
      const int g = c8 / group;
      acc += __bfloat162float(__ldg(sc + g)) * d + __bfloat162float(__ldg(bi + g)) * xsum;
    }
  }
  return acc;
}

// Row r of part (w, s, b offsets) of a quantised block.
template <int BITS>
__device__ __forceinline__ float qblock_row(const uint8_t* B, size_t w, size_t s, size_t b, int row_bytes, int group,
                                            int r, const float* x, int cols, int lane) {
  const int gpr = cols / group;
  return qrow_dot<BITS>(B + w + size_t(r) * row_bytes, reinterpret_cast<const __nv_bfloat16*>(B + s) + size_t(r) * gpr,
                        reinterpret_cast<const __nv_bfloat16*>(B + b) + size_t(r) * gpr, group, x, cols, lane);
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j.
template <int BITS, typename TS>
__global__ void __launch_bounds__(kThreads) gate_up_q_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) float xs[];
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  pdl_wait();
  pdl_trigger();
  load_x(a.xn ? a.xn : a.x, a.xn ? nullptr : a.norm_w, a.eps, a.H, xs);
  const uint8_t* B = shared ? nullptr : static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
  const TS* S = static_cast<const TS*>(a.s_gu);
  for (int r = blockIdx.x * kWarps + warp; r < I; r += gridDim.x * kWarps) {
    float g, u;
    if (shared) {
      g = row_dot<TS>(S + size_t(r) * a.H, xs, a.H, lane);
      u = row_dot<TS>(S + size_t(I + r) * a.H, xs, a.H, lane);
    } else {
      g = qblock_row<BITS>(B, 0, q.gate_s, q.gate_b, q.gu_row, q.group, r, xs, a.H, lane);
      u = qblock_row<BITS>(B, q.up_w, q.up_s, q.up_b, q.gu_row, q.group, r, xs, a.H, lane);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) a.hb[j * a.maxI + r] = siluf_(g) * u;
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j, one warp per row, slots in order.
template <int BITS, typename TS>
__global__ void __launch_bounds__(kThreads) down_q_kernel(MoeArgs a, QExpert q) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slots = a.k + (a.has_shared ? 1 : 0);
  pdl_wait();
  pdl_trigger();
  for (int r = blockIdx.x * kWarps + warp; r < a.H; r += gridDim.x * kWarps) {
    float acc = 0.f;
    for (int j = 0; j < slots; ++j) {
      const float* h = a.hb + j * a.maxI;
      float d;
      if (j == a.k) {
        d = row_dot<TS>(static_cast<const TS*>(a.s_down) + size_t(r) * a.Is, h, a.Is, lane);
      } else {
        const uint8_t* B = static_cast<const uint8_t*>(a.sel ? a.sel[a.k + j] : a.down_tab[a.ids[j]]);
        d = qblock_row<BITS>(B, 0, q.dn_s, q.dn_b, q.dn_row, q.group, r, h, a.I, lane);
      }
      acc += a.w[j] * warp_sum(d);
    }
    if (lane == 0) a.x[r] += acc;
  }
}

}  // namespace flashmoe::cuda
