// A warp's dot product of one GGUF row with x, one whole block per warp
// iteration for the kinds that dominate a Q4_K_M file (Q4_K, Q6_K), so each
// load instruction of the warp reads one contiguous run of the block
// (Q4_K: the 128 nibble bytes in one 128-byte load, 4 bytes a lane; Q6_K:
// ql/qh in 64-byte runs, 2 bytes a lane) and each lane decodes its scales
// once per block. The 8-column reader (gguf_weights8: a lane reads 8
// consecutive weights, lanes of a warp scattered over the row's blocks) is
// kept for the other kinds and for rows not aligned for these loads.
// Weights are exactly gguf_weights8's values (same arithmetic); only the
// summation order differs. Host-callable: tests/block_quant_test.cpp runs
// the 32 lanes on the CPU against the block kernels' row products.
#pragma once
#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#include "backend/cuda/gguf_blocks.cuh"

// Loop unrolling in device code; nothing in host code (the tests, nvcc's
// host pass), whose compiler does not know the pragma.
#ifdef __CUDA_ARCH__
#define FM_UNROLL _Pragma("unroll")
#define FM_UNROLL4 _Pragma("unroll 4")
#else
#define FM_UNROLL
#define FM_UNROLL4
#endif

namespace flashmoe::cuda {

FM_HD uint32_t gguf_load_u32(const uint8_t* p) {  // p 4-byte aligned
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}
FM_HD uint32_t gguf_load_u16(const uint8_t* p) {  // p 2-byte aligned
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint16_t*>(p);
#else
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8);
#endif
}

// gguf_k_scale_min from the 12 scale bytes as three little-endian words
// s0 = bytes 0..3, s1 = 4..7, s2 = 8..11 (shifts, no byte indexing: the
// words stay in registers).
FM_HD void gguf_k_scale_min_words(int j, uint32_t s0, uint32_t s1, uint32_t s2, int& sc, int& mn) {
  const int sh = 8 * (j & 3);
  if (j < 4) {
    sc = int((s0 >> sh) & 63);
    mn = int((s1 >> sh) & 63);
  } else {
    sc = int(((s2 >> sh) & 0xF) | (((s0 >> sh) >> 6 & 3) << 4));
    mn = int(((s2 >> sh) >> 4 & 0xF) | (((s1 >> sh) >> 6 & 3) << 4));
  }
}

// f16 bits (low 16 bits of h) -> f32, as gguf_half (on the device the
// hardware conversion: exact too).
FM_HD float gguf_half_bits(uint32_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu)));
#else
  const uint8_t p[2] = {uint8_t(h), uint8_t(h >> 8)};
  return gguf_half(p);
#endif
}

// A small unsigned integer v (< 2^23) as a float, exactly, minus `off`
// (an integer < 2^23): v's bits under the exponent of 2^23 make the float
// 2^23 + v, and one subtraction leaves v - off. Replaces an int-to-float
// conversion, which issues at a quarter of the FP32 rate, per weight.
FM_HD float gguf_small_f32(uint32_t v, float off) { return bits_to_f32(0x4B000000u | v) - (8388608.0f + off); }
// Byte I of w (a value < 256) as a float, exactly (one byte permute on the device).
template <int I>
FM_HD float gguf_byte_f32(uint32_t w) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | I)) - 8388608.0f;
#else
  return gguf_small_f32((w >> (8 * I)) & 0xFFu, 0.0f);
#endif
}

// Lane `lane`'s share of the dot of one Q4_K block b (256 weights, x at the
// block's first column): its 4 nibble bytes at 16 + 32g + j (g = lane / 8,
// j = 4 * (lane % 8)) hold weights 64g + j .. +3 (low nibbles, sub-block
// 2g) and 64g + 32 + j .. +3 (high nibbles, sub-block 2g + 1). Lanes 8g ..
// 8g + 7 read x at 8 consecutive float4s: no shared-memory bank conflicts.
FM_HD float gguf_q4k_lane_dot(const uint8_t* b, const float* x, int lane) {
  const int g = lane >> 3, j = (lane & 7) * 4;
  // The block's first 16 bytes (d, dmin, the 12 scale/min bytes) in one
  // load (the same address for all lanes), its nibbles in another.
  uint32_t hd[4];
#ifdef __CUDA_ARCH__
  const uint4 v = *reinterpret_cast<const uint4*>(b);
  hd[0] = v.x, hd[1] = v.y, hd[2] = v.z, hd[3] = v.w;
#else
  std::memcpy(hd, b, 16);
#endif
  const uint32_t q = gguf_load_u32(b + 16 + 32 * g + j);
  int sc0, mn0, sc1, mn1;
  gguf_k_scale_min_words(2 * g, hd[1], hd[2], hd[3], sc0, mn0);
  gguf_k_scale_min_words(2 * g + 1, hd[1], hd[2], hd[3], sc1, mn1);
  const float d = gguf_half_bits(hd[0] & 0xFFFF), dm = gguf_half_bits(hd[0] >> 16);
  const float d0 = d * float(sc0), m0 = dm * float(mn0), d1 = d * float(sc1), m1 = dm * float(mn1);
  const float* x0 = x + 64 * g + j;
  const float* x1 = x0 + 32;
#ifdef __CUDA_ARCH__
  const float4 a = *reinterpret_cast<const float4*>(x0), c = *reinterpret_cast<const float4*>(x1);
  const float xa[4] = {a.x, a.y, a.z, a.w}, xc[4] = {c.x, c.y, c.z, c.w};
#else
  const float* xa = x0;
  const float* xc = x1;
#endif
  // sum (d0 q - m0) x = d0 sum q x - m0 sum x: per weight a byte permute,
  // one subtraction and one FMA.
  const uint32_t lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
  const float q0[4] = {gguf_byte_f32<0>(lo), gguf_byte_f32<1>(lo), gguf_byte_f32<2>(lo), gguf_byte_f32<3>(lo)};
  const float q1[4] = {gguf_byte_f32<0>(hi), gguf_byte_f32<1>(hi), gguf_byte_f32<2>(hi), gguf_byte_f32<3>(hi)};
  float s0 = 0.f, s1 = 0.f, x0s = 0.f, x1s = 0.f;
FM_UNROLL
  for (int i = 0; i < 4; ++i) {
    s0 += q0[i] * xa[i];
    s1 += q1[i] * xc[i];
    x0s += xa[i];
    x1s += xc[i];
  }
  return (d0 * s0 - m0 * x0s) + (d1 * s1 - m1 * x1s);
}

// Lane l8 (0..7) of the quarter-warp that takes Q4_K block b (x at the
// block's first column): the lane's 16 nibble bytes at 16 + 16 l8 hold 32
// weights, elements 16h .. 16h + 15 (h = l8 % 2) of sub-blocks 2j (low
// nibbles) and 2j + 1 (high), j = l8 / 2: the same two scale/min pairs as
// gguf_q4k_lane_dot decodes for 8 weights, here for 32, so a block costs
// the warp about a third of the instructions. The lane walks its four
// 4-weight words starting at word j (rotated): the 8 lanes' float4 reads of
// x then fall on 8 different bank groups (in order they would share 2).
FM_HD float gguf_q4k_quarter_dot(const uint8_t* b, const float* x, int l8) {
  const int j = l8 >> 1, h = l8 & 1;
  uint32_t hd[4], w[4];
#ifdef __CUDA_ARCH__
  const uint4 v = *reinterpret_cast<const uint4*>(b);
  hd[0] = v.x, hd[1] = v.y, hd[2] = v.z, hd[3] = v.w;
  const uint4 qv = *reinterpret_cast<const uint4*>(b + 16 + 16 * l8);
  w[0] = qv.x, w[1] = qv.y, w[2] = qv.z, w[3] = qv.w;
#else
  std::memcpy(hd, b, 16);
  std::memcpy(w, b + 16 + 16 * l8, 16);
#endif
  // w[t] = word (t + j) % 4 (selects: an array indexed at run time would live in local memory).
  if (j & 1) {
    const uint32_t t0 = w[0];
    w[0] = w[1], w[1] = w[2], w[2] = w[3], w[3] = t0;
  }
  if (j & 2) {
    uint32_t t0 = w[0], t1 = w[1];
    w[0] = w[2], w[1] = w[3], w[2] = t0, w[3] = t1;
  }
  int sc0, mn0, sc1, mn1;
  gguf_k_scale_min_words(2 * j, hd[1], hd[2], hd[3], sc0, mn0);
  gguf_k_scale_min_words(2 * j + 1, hd[1], hd[2], hd[3], sc1, mn1);
  const float d = gguf_half_bits(hd[0] & 0xFFFF), dm = gguf_half_bits(hd[0] >> 16);
  const float d0 = d * float(sc0), m0 = dm * float(mn0), d1 = d * float(sc1), m1 = dm * float(mn1);
  const float* xl = x + 64 * j + 16 * h;  // sub-block 2j's 16 elements; 2j + 1's at +32
  float s0 = 0.f, s1 = 0.f, x0s = 0.f, x1s = 0.f;
FM_UNROLL
  for (int t = 0; t < 4; ++t) {
    const int o = 4 * ((t + j) & 3);
    float xa[4], xc[4];
#ifdef __CUDA_ARCH__
    const float4 a = *reinterpret_cast<const float4*>(xl + o), c = *reinterpret_cast<const float4*>(xl + 32 + o);
    xa[0] = a.x, xa[1] = a.y, xa[2] = a.z, xa[3] = a.w, xc[0] = c.x, xc[1] = c.y, xc[2] = c.z, xc[3] = c.w;
#else
    for (int i = 0; i < 4; ++i) xa[i] = xl[o + i], xc[i] = xl[32 + o + i];
#endif
    const uint32_t lo = w[t] & 0x0F0F0F0Fu, hi = (w[t] >> 4) & 0x0F0F0F0Fu;
    const float q0[4] = {gguf_byte_f32<0>(lo), gguf_byte_f32<1>(lo), gguf_byte_f32<2>(lo), gguf_byte_f32<3>(lo)};
    const float q1[4] = {gguf_byte_f32<0>(hi), gguf_byte_f32<1>(hi), gguf_byte_f32<2>(hi), gguf_byte_f32<3>(hi)};
FM_UNROLL
    for (int i = 0; i < 4; ++i) {
      s0 += q0[i] * xa[i];
      s1 += q1[i] * xc[i];
      x0s += xa[i];
      x1s += xc[i];
    }
  }
  return (d0 * s0 - m0 * x0s) + (d1 * s1 - m1 * x1s);
}

// Lane `lane`'s share of the dot of one Q6_K block b (210 bytes: ql 128, qh
// 64, 16 int8 scales, d): half h = lane / 16 (128 weights), positions l =
// 2 * (lane % 16) .. +1, each giving the 4 weights l, l + 32, l + 64, l + 96
// of the half from ql[l], ql[l + 32] and qh[l] (2-byte loads: a block is
// only 2-byte aligned).
FM_HD float gguf_q6k_lane_dot(const uint8_t* b, const float* x, int lane) {
  const int h = lane >> 4, l = (lane & 15) * 2;
  const uint32_t lo = gguf_load_u16(b + 64 * h + l), hi = gguf_load_u16(b + 64 * h + 32 + l);
  const uint32_t qh = gguf_load_u16(b + 128 + 32 * h + l);
  const float d = gguf_half_bits(gguf_load_u16(b + 208));
  const uint8_t* sc = b + 192 + 8 * h + l / 16;
  const float s[4] = {d * float(int8_t(sc[0])), d * float(int8_t(sc[2])), d * float(int8_t(sc[4])),
                      d * float(int8_t(sc[6]))};
  const float* xh = x + 128 * h + l;
  float xv[2][4];  // xv[i][u] = x at l + i + 32u of the half
FM_UNROLL
  for (int u = 0; u < 4; ++u) {
#ifdef __CUDA_ARCH__
    const float2 t = *reinterpret_cast<const float2*>(xh + 32 * u);
    xv[0][u] = t.x, xv[1][u] = t.y;
#else
    xv[0][u] = xh[32 * u], xv[1][u] = xh[32 * u + 1];
#endif
  }
  // sum over u of s[u] * (sum over i of (q - 32) x): the 6-bit codes as
  // exact floats (gguf_small_f32), one FMA per weight.
  float t[4] = {0.f, 0.f, 0.f, 0.f};
FM_UNROLL
  for (int i = 0; i < 2; ++i) {
    const uint32_t a = (lo >> (8 * i)) & 0xFF, c = (hi >> (8 * i)) & 0xFF, e = (qh >> (8 * i)) & 0xFF;
    const uint32_t q[4] = {(a & 0xF) | ((e & 3) << 4), (c & 0xF) | (((e >> 2) & 3) << 4), (a >> 4) | (((e >> 4) & 3) << 4),
                           (c >> 4) | (((e >> 6) & 3) << 4)};
FM_UNROLL
    for (int u = 0; u < 4; ++u) t[u] += gguf_small_f32(q[u], 32.0f) * xv[i][u];
  }
  return (s[0] * t[0] + s[1] * t[1]) + (s[2] * t[2] + s[3] * t[3]);
}

// Whether gguf_lane_row_dot reads rows of kind k at row a block per warp
// iteration (the kind has a block reader and row is aligned for its loads:
// Q4_K 16 bytes, as upload.cu places every part; Q6_K 2 bytes).
FM_HD bool gguf_block_per_warp(int k, const uint8_t* row) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(row);
  return (k == GQ_Q4_K && (a & 15) == 0) || (k == GQ_Q6_K && (a & 1) == 0);
}

// Lane `lane`'s share of row . x (cols columns, kind k); the warp's shares
// sum to the dot. x: cols floats, 16-byte aligned.
FM_HD float gguf_lane_row_dot(int k, const uint8_t* row, const float* x, int cols, int lane) {
  float acc = 0.f;
  if (gguf_block_per_warp(k, row)) {
    const int nb = cols / 256;
    if (k == GQ_Q4_K && nb % 4 == 0) {
      // A quarter-warp a block, four blocks a warp step (rows of fewer
      // blocks would leave quarters idle: the whole warp a block below).
      const int g = lane >> 3, l8 = lane & 7;
FM_UNROLL4
      for (int i = g; i < nb; i += 4) acc += gguf_q4k_quarter_dot(row + size_t(i) * 144, x + 256 * i, l8);
    } else if (k == GQ_Q4_K) {
FM_UNROLL4
      for (int i = 0; i < nb; ++i) acc += gguf_q4k_lane_dot(row + size_t(i) * 144, x + 256 * i, lane);
    } else {
FM_UNROLL4
      for (int i = 0; i < nb; ++i) acc += gguf_q6k_lane_dot(row + size_t(i) * 210, x + 256 * i, lane);
    }
    return acc;
  }
  for (int c = lane * 8; c < cols; c += 32 * 8) {
    float w[8];
    gguf_weights8(k, row, c, w);
#ifdef __CUDA_ARCH__
    const float4 a = *reinterpret_cast<const float4*>(x + c), b = *reinterpret_cast<const float4*>(x + c + 4);
    acc += ((w[0] * a.x + w[1] * a.y) + (w[2] * a.z + w[3] * a.w)) + ((w[4] * b.x + w[5] * b.y) + (w[6] * b.z + w[7] * b.w));
#else
    for (int i = 0; i < 8; ++i) acc += w[i] * x[c + i];
#endif
  }
  return acc;
}

}  // namespace flashmoe::cuda
