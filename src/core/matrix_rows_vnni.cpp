// The AVX512-VNNI level of core/matrix_rows.h's int8 row dot: vpdpbusd
// multiplies 32 unsigned weight codes (q8 bytes, or q4 nibbles spread to
// bytes) by 32 signed activation codes and adds them in fours into eight
// int32 lanes, one instruction where the fp32 path needs a widening, a
// conversion and a multiply-add per 8 weights. A group's integer sums are
// exact (at most 8 products of 255 x 127 per lane and 64-column group pass;
// 2^31 is far), so the only rounding is the activations' own.
#include "core/matrix_rows_levels.h"

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "core/x86_hsum.h"

#include "core/dtype.h"

#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

namespace flashmoe::cpu::vnni {

namespace {

// Thirty-two q4 codes from 16 bytes (low nibble = the even column) as bytes
// in column order.
VNNI_FN inline __m256i q4_bytes(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

// Sixty-four q4 codes from 32 bytes as bytes in column order.
VNNI_FN inline __m512i q4_bytes64(const uint8_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
  // unpack works within 128-bit lanes: lane i of lo/hi holds columns
  // [32i, 32i + 32), so the pairs (unpacklo, unpackhi) of each lane are
  // columns [32i, 32i + 16) and [32i + 16, 32i + 32).
  const __m256i a = _mm256_unpacklo_epi8(lo, hi), c = _mm256_unpackhi_epi8(lo, hi);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(a, c, 0x20)),
                            _mm256_permute2x128_si256(a, c, 0x31), 1);
}

// Groups that are a multiple of 64: one 64-byte vpdpbusd per 64 weights.
VNNI_FN float dot_row_int8_512(const Matrix& W, const uint8_t* row, const uint16_t* s, const uint16_t* b,
                               const int8_t* code, const float* scale, const float* sum) {
  const int64_t G = W.groups_per_row(), gs = W.group;
  __m512 acc = _mm512_setzero_ps();
  float bias = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* xg = code + g * gs;
    __m512i dot = _mm512_setzero_si512();
    if (W.quant == QuantKind::Q8) {
      const uint8_t* wg = row + g * gs;
      for (int64_t c = 0; c < gs; c += 64)
        dot = _mm512_dpbusd_epi32(dot, _mm512_loadu_si512(wg + c), _mm512_loadu_si512(xg + c));
    } else {
      const uint8_t* wg = row + g * gs / 2;
      for (int64_t c = 0; c < gs; c += 64)
        dot = _mm512_dpbusd_epi32(dot, q4_bytes64(wg + c / 2), _mm512_loadu_si512(xg + c));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(bf16_to_f32(s[g]) * scale[g]), acc);
    bias += bf16_to_f32(b[g]) * sum[g];
  }
  return _mm512_reduce_add_ps(acc) + bias;
}

}  // namespace

VNNI_FN float quant_dot_row_int8(const Matrix& W, int64_t r, const int8_t* code, const float* scale,
                                 const float* sum) {
  const uint8_t* row = static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes();
  const int64_t G = W.groups_per_row(), gs = W.group;
  const uint16_t* s = W.scales + r * G;
  const uint16_t* b = W.biases + r * G;
  if (gs % 64 == 0) return dot_row_int8_512(W, row, s, b, code, scale, sum);
  __m256 acc = _mm256_setzero_ps();
  float bias = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* xg = code + g * gs;
    __m256i dot = _mm256_setzero_si256();
    if (W.quant == QuantKind::Q8) {
      const uint8_t* wg = row + g * gs;
      for (int64_t c = 0; c < gs; c += 32)
        dot = _mm256_dpbusd_epi32(dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c)),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + c)));
    } else {
      const uint8_t* wg = row + g * gs / 2;
      for (int64_t c = 0; c < gs; c += 32)
        dot = _mm256_dpbusd_epi32(dot, q4_bytes(wg + c / 2),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + c)));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(bf16_to_f32(s[g]) * scale[g]), acc);
    bias += bf16_to_f32(b[g]) * sum[g];
  }
  return hsum8(acc) + bias;
}

}  // namespace flashmoe::cpu::vnni
#endif
