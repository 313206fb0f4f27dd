// The device layout of dense GGUF matrices (projections, lm_head) repacked
// at upload for the decode matvec (gguf_dense_matvec.cuh): the file's codes,
// rearranged, never dequantised. A row is a run of repacked blocks of 256
// columns, each of 8 groups of 32 columns:
//   [0, 128)            low 4 bits of the codes, 16 bytes a group: byte b
//                       of word k holds column 8k + b (low nibble) and
//                       8k + 4 + b (high nibble), so a lane's one 16-byte
//                       load is its group's 32 columns;
//   [128, 128 + 32h)    the codes' high h bits (h = 0, 1, 2, 4), 4h bytes a
//                       group: set s (columns 4s .. 4s + 3) sits in word
//                       s / (8 / h) at bit p = h * (s % (8 / h)) of each
//                       byte, so one shift and one mask put the 4 codes'
//                       high bits at bit 4 of their bytes;
//   [128 + 32h, +64)    per group a float pair, computed at upload (exact:
//                       an f16 times a small integer): kinds with a min
//                       (Q4_K, Q5_K, Q4_1, Q5_1) (scale, min), a weight
//                       scale * code - min; the others the scales of
//                       columns 0..15 and 16..31, a weight scale * (code -
//                       off) (Q6_K's scales are per 16 columns).
// The weights are bit for bit ggml's (gguf_weights8 of the file's blocks),
// so the batched prefill reads repacked rows through gguf_weights8 too.
// Why (bench/NOTES-cuda.md, "Session 8: dense GGUF repacked"): the file's
// blocks cost the decode readers ~10 instructions a weight (scale unpacking,
// addresses, per-block heads paid for few weights a lane); here a lane pays
// about 3 (a byte permute, a subtraction, an FMA) and one 16-byte load of
// codes per 32 weights. Host-callable: tests/block_quant_test.cpp checks
// the readers against the file's blocks without a GPU.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifndef FM_HD
#ifdef __CUDACC__
#define FM_HD __host__ __device__ __forceinline__
#else
#define FM_HD inline
#endif
#endif

namespace flashmoe::cuda {

// A repacked kind is kGDense + the file's kind (a QuantKind, as GMat's kinds).
constexpr int kGDense = 32;
FM_HD bool gdense_kind(int k) { return k >= kGDense; }

// What a repacked kind's codes are (file kinds by their QuantKind values:
// Q8_0 4, Q4_0 5, Q4_1 6, Q5_0 7, Q5_1 8, Q4_K 9, Q5_K 10, Q6_K 11).
struct GDenseKind {
  int h;      // high bits per code (codes have 4 + h bits)
  int off;    // kinds without a min: the code's offset (weight = scale * (code - off))
  bool min;   // the pair is (scale, min), weight = scale * code - min
};
FM_HD GDenseKind gdense_info(int k) {
  switch (k - kGDense) {
    case 4: return {4, 128, false};  // Q8_0: the int8 code + 128
    case 5: return {0, 8, false};    // Q4_0
    case 6: return {0, 0, true};     // Q4_1 (min: minus the block's m)
    case 7: return {1, 16, false};   // Q5_0
    case 8: return {1, 0, true};     // Q5_1
    case 9: return {0, 0, true};     // Q4_K
    case 10: return {1, 0, true};    // Q5_K
    default: return {2, 32, false};  // Q6_K
  }
}
// f(H, MIN) for kind `in`'s high bits and min as std::integral_constant
// arguments (the readers are templates on both: their loops unrolled per
// kind); f a generic lambda (C++17: the CUDA units' standard).
template <typename F>
FM_HD void gdense_with_kind(const GDenseKind& in, F&& f) {
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using T = std::true_type;
  using N = std::false_type;
  switch (in.h * 2 + (in.min ? 1 : 0)) {
    case 0: f(I0{}, N{}); break;
    case 1: f(I0{}, T{}); break;
    case 2: f(I1{}, N{}); break;
    case 3: f(I1{}, T{}); break;
    case 4: f(I2{}, N{}); break;
    default: f(I4{}, N{}); break;
  }
}
FM_HD int gdense_block_bytes(int k) { return 192 + 32 * gdense_info(k).h; }

// The float whose IEEE bits are b (the GGUF readers' f16 and scale decoding).
FM_HD float bits_to_f32(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// Byte I of w (< 256) minus off as a float, exactly: the byte under the
// exponent of 2^23 (one byte permute on the device), one subtraction.
template <int I>
FM_HD float gdense_code_f32(uint32_t w, float off) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | I)) - (8388608.0f + off);
#else
  return bits_to_f32(0x4B000000u | ((w >> (8 * I)) & 0xFFu)) - (8388608.0f + off);
#endif
}

// The codes of set s (columns 4s .. 4s + 3 of a group), one a byte, from
// the group's low-nibble words lo[4] and high-bit words hi[h].
template <int H>
FM_HD uint32_t gdense_set_codes(const uint32_t* lo, const uint32_t* hi, int s) {
  const uint32_t w = lo[s >> 1];
  uint32_t c = (s & 1) ? (w >> 4) & 0x0F0F0F0Fu : w & 0x0F0F0F0Fu;
  if constexpr (H > 0) {
    constexpr int per = 8 / H;
    const uint32_t hw = hi[s / per];
    const int p = H * (s % per);
    const uint32_t at4 = p <= 4 ? hw << (4 - p) : hw >> (p - 4);
    c |= at4 & (((1u << H) - 1u) * 0x10101010u);
  }
  return c;
}

// A group's words: lo[4] its low-nibble words, hi[h] its high-bit words,
// p0 / p1 its pair (b: the repacked block, j: the group).
FM_HD void gdense_load_group(const uint8_t* b, int j, int h, uint32_t* lo, uint32_t* hi, float& p0, float& p1) {
  const uint8_t* q = b + 16 * j;
  const uint8_t* e = b + 128 + 4 * h * j;
  const uint8_t* p = b + 128 + 32 * h + 8 * j;
#ifdef __CUDA_ARCH__
  const uint4 v = *reinterpret_cast<const uint4*>(q);
  lo[0] = v.x, lo[1] = v.y, lo[2] = v.z, lo[3] = v.w;
  if (h == 1) {
    hi[0] = *reinterpret_cast<const uint32_t*>(e);
  } else if (h == 2) {
    const uint2 t = *reinterpret_cast<const uint2*>(e);
    hi[0] = t.x, hi[1] = t.y;
  } else if (h == 4) {
    const uint4 t = *reinterpret_cast<const uint4*>(e);
    hi[0] = t.x, hi[1] = t.y, hi[2] = t.z, hi[3] = t.w;
  }
  const float2 f = *reinterpret_cast<const float2*>(p);
  p0 = f.x, p1 = f.y;
#else
  std::memcpy(lo, q, 16);
  std::memcpy(hi, e, size_t(4 * h));
  std::memcpy(&p0, p, 4);
  std::memcpy(&p1, p + 4, 4);
#endif
}

// Weights c .. c + 7 (c a multiple of 8) of a repacked row of kind k: the
// file's values exactly (gguf_weights8's arithmetic).
FM_HD void gdense_weights8(int k, const uint8_t* row, int c, float* w) {
  const GDenseKind in = gdense_info(k);
  const uint8_t* b = row + size_t(c / 256) * gdense_block_bytes(k);
  const int j = (c % 256) / 32, s0 = (c % 32) / 4;  // group, first set (2 sets: 8 columns)
  uint32_t lo[4], hi[4] = {0, 0, 0, 0};
  float p0, p1;
  gdense_load_group(b, j, in.h, lo, hi, p0, p1);
  for (int t = 0; t < 2; ++t) {
    const int s = s0 + t;
    const uint32_t q = in.h == 0   ? gdense_set_codes<0>(lo, hi, s)
                       : in.h == 1 ? gdense_set_codes<1>(lo, hi, s)
                       : in.h == 2 ? gdense_set_codes<2>(lo, hi, s)
                                   : gdense_set_codes<4>(lo, hi, s);
    for (int i = 0; i < 4; ++i) {
      const float u = float(int((q >> (8 * i)) & 0xFFu));
      w[4 * t + i] = in.min ? p0 * u - p1 : (s >= 4 ? p1 : p0) * (u - float(in.off));
    }
  }
}

// A lane's group of 32 columns in R rows (the words gdense_load_group reads).
template <int H, int R>
struct GDenseRows {
  uint32_t lo[R][4], hi[R][H > 0 ? H : 1];
  float p0[R], p1[R];
};

// acc[i] += row i's group . x for the R rows of d: the group's x in
// column order as 8 float4s, float4 s at x + 4 (s ^ sw) (the kernel's
// swizzle; 16-byte aligned), sx the group's sum of x (kinds with a min),
// off the codes' offset. Per weight a byte permute, a subtraction and an
// FMA; each float4 of x read once for the R rows, R independent chains.
template <int H, bool MIN, int R>
FM_HD void gdense_rows_dot(const GDenseRows<H, R>& d, const float* x, int sw, float sx, float off, float (&acc)[R]) {
  float t0[R], t1[R];  // columns 0..15 and 16..31 of each row
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int i = 0; i < R; ++i) t0[i] = t1[i] = 0.f;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int s = 0; s < 8; ++s) {
    float v[4];
#ifdef __CUDA_ARCH__
    const float4 f = *reinterpret_cast<const float4*>(x + 4 * (s ^ sw));
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
#else
    std::memcpy(v, x + 4 * (s ^ sw), 16);
#endif
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int i = 0; i < R; ++i) {
      const uint32_t q = gdense_set_codes<H>(d.lo[i], d.hi[i], s);
      float t = s < 4 ? t0[i] : t1[i];
      t = fmaf(gdense_code_f32<0>(q, off), v[0], t);
      t = fmaf(gdense_code_f32<1>(q, off), v[1], t);
      t = fmaf(gdense_code_f32<2>(q, off), v[2], t);
      t = fmaf(gdense_code_f32<3>(q, off), v[3], t);
      if (s < 4) t0[i] = t;
      else t1[i] = t;
    }
  }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int i = 0; i < R; ++i)
    acc[i] += MIN ? d.p0[i] * (t0[i] + t1[i]) - d.p1[i] * sx : d.p0[i] * t0[i] + d.p1[i] * t1[i];
}

}  // namespace flashmoe::cuda
