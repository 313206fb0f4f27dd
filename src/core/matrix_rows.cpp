#include "core/matrix_rows.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/block_quant.h"
#include "core/error.h"
#include "core/fp8_rows.h"
#include "core/matrix_rows_levels.h"
#include "core/simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "core/x86_hsum.h"
#define FLASHMOE_X86 1
#define AVX2_FN __attribute__((target("avx2,fma")))
#endif

namespace flashmoe::cpu {

namespace {

inline int q_at(QuantKind k, const uint8_t* row, int64_t c) {
  if (k == QuantKind::Q8) return row[c];
  uint8_t b = row[c >> 1];
  return (c & 1) ? (b >> 4) : (b & 0xF);
}

const uint8_t* row_ptr(const Matrix& W, int64_t r) {
  return static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes();
}

// Portable versions: the reference the AVX2 ones must match.
void dequant_generic(const Matrix& W, int64_t r, float* out) {
  const uint8_t* row = row_ptr(W, r);
  const int64_t G = W.groups_per_row();
  for (int64_t g = 0; g < G; ++g) {
    const float s = bf16_to_f32(W.scales[r * G + g]), b = bf16_to_f32(W.biases[r * G + g]);
    for (int64_t c = g * W.group; c < (g + 1) * W.group; ++c) out[c] = float(q_at(W.quant, row, c)) * s + b;
  }
}

float dot_generic(const Matrix& W, int64_t r, const float* x) {
  const uint8_t* row = row_ptr(W, r);
  const int64_t G = W.groups_per_row();
  float acc = 0;
  for (int64_t g = 0; g < G; ++g) {
    const float s = bf16_to_f32(W.scales[r * G + g]), b = bf16_to_f32(W.biases[r * G + g]);
    float part = 0;
    for (int64_t c = g * W.group; c < (g + 1) * W.group; ++c) part += (float(q_at(W.quant, row, c)) * s + b) * x[c];
    acc += part;
  }
  return acc;
}

#ifdef FLASHMOE_X86
// Eight consecutive quantised values starting at column c (c % 8 == 0) as fp32.
AVX2_FN inline __m256 load_q8x8(QuantKind k, const uint8_t* row, int64_t c) {
  if (k == QuantKind::Q8) {
    __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  }
  // One uint32 holds the eight nibbles, lowest first: shift each lane by 4*lane.
  uint32_t u;
  __builtin_memcpy(&u, row + c / 2, 4);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(u)), shifts), _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(q);
}

AVX2_FN void dequant_avx2(const Matrix& W, int64_t r, float* out) {
  const uint8_t* row = row_ptr(W, r);
  const int64_t G = W.groups_per_row();
  for (int64_t g = 0; g < G; ++g) {
    const __m256 s = _mm256_set1_ps(bf16_to_f32(W.scales[r * G + g]));
    const __m256 b = _mm256_set1_ps(bf16_to_f32(W.biases[r * G + g]));
    for (int64_t c = g * W.group; c < (g + 1) * W.group; c += 8)
      _mm256_storeu_ps(out + c, _mm256_fmadd_ps(load_q8x8(W.quant, row, c), s, b));
  }
}

AVX2_FN float dot_avx2(const Matrix& W, int64_t r, const float* x) {
  const uint8_t* row = row_ptr(W, r);
  const int64_t G = W.groups_per_row();
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t g = 0; g < G; ++g) {
    const __m256 s = _mm256_set1_ps(bf16_to_f32(W.scales[r * G + g]));
    const __m256 b = _mm256_set1_ps(bf16_to_f32(W.biases[r * G + g]));
    int64_t c = g * W.group;
    const int64_t end = c + W.group;
    for (; c + 16 <= end; c += 16) {
      a0 = _mm256_fmadd_ps(_mm256_fmadd_ps(load_q8x8(W.quant, row, c), s, b), _mm256_loadu_ps(x + c), a0);
      a1 = _mm256_fmadd_ps(_mm256_fmadd_ps(load_q8x8(W.quant, row, c + 8), s, b), _mm256_loadu_ps(x + c + 8), a1);
    }
    for (; c < end; c += 8)
      a0 = _mm256_fmadd_ps(_mm256_fmadd_ps(load_q8x8(W.quant, row, c), s, b), _mm256_loadu_ps(x + c), a0);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}
#endif

void check(const Matrix& W) {
  if (W.group <= 0 || W.group % 8 != 0 || W.cols % W.group != 0 || !W.scales || !W.biases)
    fail("quantised matrix [" + std::to_string(W.rows) + ", " + std::to_string(W.cols) +
         "] has an invalid group size " + std::to_string(W.group) + " (must divide cols and be a multiple of 8)");
}

}  // namespace

void quant_dequant_row_at(CpuLevel level, const Matrix& W, int64_t r, float* out) {
  if (W.fp8()) {
    if (level >= CpuLevel::Avx2) return fp8_rows::dequant_avx2(W, r, out);
    return fp8_rows::dequant_portable(W, r, out);
  }
  if (W.block_quantized()) return block_dequant_row(W, r, out);
  check(W);
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx512 && W.group % 16 == 0) return avx512::quant_dequant_row(W, r, out);
  if (level >= CpuLevel::Avx2) return dequant_avx2(W, r, out);
#endif
  dequant_generic(W, r, out);
}

float quant_dot_row_at(CpuLevel level, const Matrix& W, int64_t r, const float* x) {
  if (W.fp8()) {
    if (level >= CpuLevel::Avx2) return fp8_rows::dot_avx2(W, r, x);
    return fp8_rows::dot_portable(W, r, x);
  }
  if (W.block_quantized()) return block_dot_row_at(level, W, r, x);
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx512 && W.group % 16 == 0) return avx512::quant_dot_row(W, r, x);
  if (level >= CpuLevel::Avx2) return dot_avx2(W, r, x);
#endif
  return dot_generic(W, r, x);
}

void quantize_activations(const float* x, int64_t cols, int64_t group, Int8Activations& out) {
  if (group <= 0 || cols % group != 0)
    fail("quantize_activations: group " + std::to_string(group) + " does not divide " + std::to_string(cols) +
         " columns");
  const int64_t G = cols / group;
  out.group = group;
  out.code.resize(size_t(cols));
  out.scale.resize(size_t(G));
  out.sum.resize(size_t(G));
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * group;
    float amax = 0, sum = 0;
    for (int64_t c = 0; c < group; ++c) {
      amax = std::max(amax, std::fabs(xg[c]));
      sum += xg[c];
    }
    const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    for (int64_t c = 0; c < group; ++c) out.code[size_t(g * group + c)] = int8_t(std::lrint(xg[c] * inv));
    out.scale[size_t(g)] = d;
    out.sum[size_t(g)] = sum;
  }
}

bool int8_dot_supported(CpuLevel level, const Matrix& W) {
#ifdef FLASHMOE_X86
  return level >= CpuLevel::Avx512Vnni && W.affine() && W.group % 32 == 0;
#else
  (void)level;
  (void)W;
  return false;
#endif
}

float quant_dot_row_int8_at(CpuLevel level, const Matrix& W, int64_t r, const Int8Activations& x) {
  if (!int8_dot_supported(level, W) || x.group != W.group || int64_t(x.code.size()) != W.cols)
    fail("quant_dot_row_int8: not available at level " + std::string(cpu_level_name(level)) + " for this matrix");
#ifdef FLASHMOE_X86
  return vnni::quant_dot_row_int8(W, r, x.code.data(), x.scale.data(), x.sum.data());
#else
  (void)r;
  return 0;
#endif
}

void quant_dequant_row(const Matrix& W, int64_t r, float* out) { quant_dequant_row_at(cpu_level(), W, r, out); }

float quant_dot_row(const Matrix& W, int64_t r, const float* x) { return quant_dot_row_at(cpu_level(), W, r, x); }

void load_row(const Matrix& W, int64_t r, float* out) {
  if (W.quantized()) return quant_dequant_row(W, r, out);
  const uint8_t* row = static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes();
  simd::to_f32(W.dtype, row, W.cols, out);
}

}  // namespace flashmoe::cpu

namespace flashmoe {
const char* quant_name(QuantKind q) {
  switch (q) {
    case QuantKind::None: return "none";
    case QuantKind::Q8: return "q8";
    case QuantKind::Q4: return "q4";
    case QuantKind::Fp8Block: return "fp8";
    case QuantKind::Q8_0: return "Q8_0";
    case QuantKind::Q4_0: return "Q4_0";
    case QuantKind::Q4_1: return "Q4_1";
    case QuantKind::Q5_0: return "Q5_0";
    case QuantKind::Q5_1: return "Q5_1";
    case QuantKind::Q4_K: return "Q4_K";
    case QuantKind::Q5_K: return "Q5_K";
    case QuantKind::Q6_K: return "Q6_K";
    case QuantKind::IQ4_NL: return "IQ4_NL";
    case QuantKind::IQ4_XS: return "IQ4_XS";
  }
  return "?";
}
}  // namespace flashmoe
