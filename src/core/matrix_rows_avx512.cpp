// The AVX-512 level of core/matrix_rows.h's q8 / q4 kernels (16 lanes), each
// function compiled for AVX-512 by its target attribute (see simd_avx512.cpp).
#include "core/matrix_rows_levels.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 intrinsics trip -Wuninitialized (see simd_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

namespace flashmoe::cpu::avx512 {

namespace {

const uint8_t* row_ptr(const Matrix& W, int64_t r) {
  return static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes();
}

// Sixteen consecutive quantised values from column c (c % 16 == 0) as fp32.
AVX512_FN inline __m512 load_q16(QuantKind k, const uint8_t* row, int64_t c) {
  if (k == QuantKind::Q8)
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
  // Eight bytes hold the sixteen nibbles, low nibble first: split and
  // interleave them back into column order.
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}

}  // namespace

AVX512_FN void quant_dequant_row(const Matrix& W, int64_t r, float* out) {
  const uint8_t* row = row_ptr(W, r);
  const int64_t G = W.groups_per_row();
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = _mm512_set1_ps(bf16_to_f32(W.scales[r * G + g]));
    const __m512 b = _mm512_set1_ps(bf16_to_f32(W.biases[r * G + g]));
    for (int64_t c = g * W.group; c < (g + 1) * W.group; c += 16)
      _mm512_storeu_ps(out + c, _mm512_fmadd_ps(load_q16(W.quant, row, c), s, b));
  }
}

// Per group: sum_c (q_c * s + b) x_c = s * sum_c q_c x_c + b * sum_c x_c,
// one multiply-add per weight instead of two.
AVX512_FN float quant_dot_row(const Matrix& W, int64_t r, const float* x) {
  const uint8_t* row = row_ptr(W, r);
  const int64_t G = W.groups_per_row();
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 qx = _mm512_setzero_ps(), xs = _mm512_setzero_ps();
    for (int64_t c = g * W.group; c < (g + 1) * W.group; c += 16) {
      const __m512 xv = _mm512_loadu_ps(x + c);
      qx = _mm512_fmadd_ps(load_q16(W.quant, row, c), xv, qx);
      xs = _mm512_add_ps(xs, xv);
    }
    acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(W.scales[r * G + g])), qx, acc);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(W.biases[r * G + g])), xs, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace flashmoe::cpu::avx512
#endif
