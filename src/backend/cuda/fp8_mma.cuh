// FP8 block weights times an fp32 vector on the tensor cores (the decode
// step's FP8 matvec and expert kernels: fp8_matvec.cuh, fp8_experts.cuh).
//
// Why: widening every code to fp32 and using an FFMA costs ~3 instructions
// per weight byte (cvt e4m3x2 -> f16x2, f16 -> f32, FFMA, plus the x
// loads), too many for the ~13 bytes per cycle per SM that decode at HBM
// speed asks for. Here a warp's 16 rows times 16 columns are one
// mma.sync.m16n8k16 (f16 in, fp32 accumulate): the codes need one cvt per
// two (E4M3 is exact in f16: 3 mantissa bits, exponents 2^-9..2^8), the
// products and sums are the tensor core's. The vector is the mma's B:
// x * 2^e split into f16 hi = f16(x 2^e) and lo = f16(x 2^e - hi) (columns
// 0 and 1 of B; 22 significant bits, the power of two 2^e puts the vector's
// largest |x| just under 2^15, inside f16's range), so row . x = (C[.,0] +
// C[.,1]) / 2^e with an error near fp32 rounding; the other six columns
// of B are zero. Each row's block scale multiplies the fp32 partial sum of
// its block (blocks a multiple of 64 columns wide: a step's 64 columns lie
// in one block); the codes are never scaled in f16.
//
// Layout of a step (64 columns at `base`, a multiple of 64): lane (g, t) =
// (lane / 4, lane % 4) loads 16 codes of row g and 16 of row g + 8 at
// base + 16 t (one coalesced 16-byte load each) and the 16 matching hi
// (g = 0) or lo (g = 1) halves of x (two 16-byte shared loads; g >= 2: zero).
// Its code word m (columns base + 16 t + 4 m .. + 3) is mma m's A for its
// k = {2t, 2t+1, 2t+8, 2t+9}, and its x words 2m, 2m+1 are mma m's B for
// the same k: the mapping of k to columns is the same for every row, so
// the four mmas sum the 64 columns exactly once. C: lane (g, 0) holds row
// g's hi and lo sums (c0, c1) and row g + 8's (c2, c3).
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "backend/cuda/common.cuh"

namespace flashmoe::cuda {

constexpr int kF8Step = 64;  // columns per warp step (4 lanes x 16 codes)

// Columns padded to whole steps.
__host__ __device__ inline int f8_padded(int cols) { return (cols + kF8Step - 1) / kF8Step * kF8Step; }
// Bytes of shared memory for a split vector of `cols` (hi, then lo 16 bytes
// further than a whole step would put it: lanes g = 0 and g = 1 of a
// quarter warp then read disjoint banks).
__host__ __device__ inline size_t f8_split_bytes(int cols) { return size_t(f8_padded(cols)) * 4 + 16; }

// A vector staged for the mma: hi at h, lo at h + lo_off halves; 1 / 2^e.
struct F8Split {
  const __half* h;
  int lo_off;
  float inv;
};

// The power of two 2^e that brings max |x| (m) just under 2^15, as its
// inverse and itself; 1 for a zero vector.
__device__ __forceinline__ float f8_scale_for(float m, float* inv) {
  int e = 0;
  if (!(m > 0.f) || !isfinite(m)) {
    *inv = 1.f;
    return 1.f;
  }
  frexpf(m, &e);  // m < 2^e
  const int s = max(-120, min(120, 15 - e));
  *inv = ldexpf(1.f, -s);
  return ldexpf(1.f, s);
}

// hi / lo halves of v * s.
__device__ __forceinline__ void f8_split_one(float v, float s, __half* hi, __half* lo) {
  const float a = v * s;
  const __half h = __float2half_rn(a);
  *hi = h;
  *lo = __float2half_rn(a - __half2float(h));
}

// xs[0, cols) (shared or global fp32) split into dst (f8_split_bytes(cols)
// bytes of shared memory) by the whole block; zero past cols up to the
// padded width (the codes there are zero, and 0 * NaN would not be).
// Ends with a barrier. Every thread gets the split's description.
__device__ __forceinline__ F8Split f8_split_block(const float* xs, int cols, __half* dst) {
  float m = 0.f;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(xs[i]));
  m = block_max(m);
  float inv;
  const float s = f8_scale_for(m, &inv);
  const int P = f8_padded(cols), lo = P + 8;
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    if (i < cols) f8_split_one(xs[i], s, dst + i, dst + lo + i);
    else dst[i] = dst[lo + i] = __float2half_rn(0.f);
  }
  __syncthreads();
  return {dst, lo, inv};
}

// The same by one warp (no barrier: the caller syncs before other warps read it).
__device__ __forceinline__ F8Split f8_split_warp(const float* x, int cols, __half* dst, int lane) {
  float m = 0.f;
  for (int i = lane; i < cols; i += 32) m = fmaxf(m, fabsf(x[i]));
  m = warp_max(m);
  float inv;
  const float s = f8_scale_for(m, &inv);
  const int P = f8_padded(cols), lo = P + 8;
  for (int i = lane; i < P; i += 32) {
    if (i < cols) f8_split_one(x[i], s, dst + i, dst + lo + i);
    else dst[i] = dst[lo + i] = __float2half_rn(0.f);
  }
  return {dst, lo, inv};
}

// Block sum of ss and block max of m in one reduction (block_sum's order for
// the sum: the same bits as load_x's).
__device__ __forceinline__ void block_sum_max(float& ss, float& m) {
  __shared__ float red[2][32];
  __shared__ float total[2];
  ss = warp_sum(ss);
  m = warp_max(m);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (l == 0) red[0][w] = ss, red[1][w] = m;
  __syncthreads();
  if (w == 0) {
    const float t = warp_sum(l < nw ? red[0][l] : 0.0f), u = warp_max(l < nw ? red[1][l] : 0.0f);
    if (l == 0) total[0] = t, total[1] = u;
  }
  __syncthreads();
  ss = total[0];
  m = total[1];
}

// x RMS-normed with the weights in pre (load_x's arithmetic: x * r * w)
// and split for the mma in one pass: max |x r w| = r max |x w| (r = 1 /
// rms(x) > 0), so one block reduction gives the norm's and the split's
// scales, and the halves go to dst straight from registers: two barriers
// and a pass over shared memory fewer than load_x then f8_split_block.
// Needs pre.on (cols <= kNormPer * blockDim.x). Ends with a barrier;
// *rx = r.
__device__ __forceinline__ F8Split f8_norm_split_block(const float* __restrict__ x, float eps, int cols,
                                                       const NormPre& pre, __half* dst, float* rx) {
  float v[kNormPer], ss = 0.f, m = 0.f;
#pragma unroll
  for (int k = 0; k < kNormPer; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = i < cols ? x[i] : 0.f;
    ss += v[k] * v[k];
    m = fmaxf(m, fabsf(v[k] * pre.w[k]));
  }
  block_sum_max(ss, m);
  const float r = 1.0f / sqrtf(ss / float(cols) + eps);
  float inv;
  const float s = f8_scale_for(r * m, &inv);
  const int P = f8_padded(cols), lo = P + 8;
#pragma unroll
  for (int k = 0; k < kNormPer; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < cols) f8_split_one(v[k] * r * pre.w[k], s, dst + i, dst + lo + i);
  }
  for (int i = cols + threadIdx.x; i < P; i += blockDim.x) dst[i] = dst[lo + i] = __float2half_rn(0.f);
  __syncthreads();
  *rx = r;
  return {dst, lo, inv};
}

// One lane's two rows in a tile: codes of row g and row g + 8 (null: past
// the matrix, read as zero) and their block scales (one per `group`
// columns, the first for column 0 of the codes).
struct F8TileRows {
  const uint8_t *w0, *w1;
  const float *s0, *s1;
};

__device__ __forceinline__ uint32_t f8_cvt2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

__device__ __forceinline__ void f8_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The four mmas of one step: codes v (row g), u (row g + 8), x words xb[8].
__device__ __forceinline__ void f8_step_mma(float (&c)[4], const uint4& v, const uint4& u, const uint4& x0,
                                            const uint4& x1) {
  const uint32_t a[4] = {v.x, v.y, v.z, v.w}, b[4] = {u.x, u.y, u.z, u.w};
  const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
  for (int m = 0; m < 4; ++m)
    f8_mma(c, f8_cvt2(a[m]), f8_cvt2(b[m]), f8_cvt2(a[m] >> 16), f8_cvt2(b[m] >> 16), xw[2 * m], xw[2 * m + 1]);
}

// Prefetches a tile's rows [k0, k1) into L2 (before a kernel's PDL wait).
__device__ __forceinline__ void f8_tile_prefetch(const F8TileRows& R, int k0, int k1, int lane) {
  const int t = lane & 3;
  for (int c = k0 + 128 * t; c < k1; c += 512) {
    if (R.w0) prefetch_l2(R.w0 + c);
    if (R.w1) prefetch_l2(R.w1 + c);
  }
}

}  // namespace flashmoe::cuda
