// Rows of an Fp8Block matrix (core/matrix.h: E4M3 codes, one fp32 scale per
// block) decoded straight from the codes, a block at a time: portable and
// AVX2 (chosen by core/matrix_rows.cpp; AVX-512 machines run the AVX2 code).
// Internal to core/.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/matrix.h"

namespace flashmoe::cpu {

// The value of an E4M3 ("E4M3FN") code: exact; the NaN codes 0x7F / 0xFF,
// which no weight holds, read as ±480.
inline float e4m3_value(uint8_t c) {
  const uint32_t e = (c >> 3) & 15, m = c & 7;
  uint32_t bits;
  float v;
  if (e == 0) {
    v = float(m) * (1.0f / 512.0f);  // subnormal: m * 2^-9
  } else {
    bits = ((e + 120) << 23) | (m << 20);  // 2^(e-7) * (1 + m/8)
    std::memcpy(&v, &bits, 4);
  }
  return (c & 0x80) ? -v : v;
}

namespace fp8_rows {
void dequant_portable(const Matrix& W, int64_t r, float* out);
float dot_portable(const Matrix& W, int64_t r, const float* x);
void dequant_avx2(const Matrix& W, int64_t r, float* out);
float dot_avx2(const Matrix& W, int64_t r, const float* x);
}  // namespace fp8_rows

}  // namespace flashmoe::cpu
