#include "core/block_quant_i16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "core/x86_hsum.h"
#define FLASHMOE_X86 1
// GCC 12's AVX-512 intrinsics trip -Wuninitialized (see simd_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

namespace flashmoe::cpu {

namespace {

constexpr float kCodeMax = 32767.0f;
constexpr float kLoSteps = 65536.0f;  // low codes per high code step

void quantize_scalar(const float* x, int64_t cols, Int16Activations& out) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0, sum = 0;
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, std::fabs(xb[i]));
      sum += xb[i];
    }
    const float inv = amax > 0 ? kCodeMax / amax : 0.0f;
    int16_t* c = out.code.data() + 64 * b;
    // Clamped as packs saturates (only a NaN or an infinity gets there).
    for (int i = 0; i < 32; ++i) {
      const long hi = std::clamp(std::lrint(xb[i] * inv), -32768L, 32767L);
      c[(i % 2) * 16 + i / 2] = int16_t(hi);
      const long lo = std::lrint(std::fma(xb[i], inv, -float(hi)) * kLoSteps);
      c[32 + (i % 2) * 16 + i / 2] = int16_t(std::clamp(lo, -32768L, 32767L));
    }
    out.scale[size_t(b)] = amax / kCodeMax;
    out.sum[size_t(b)] = sum;
  }
}

#ifdef FLASHMOE_X86
AVX2_FN inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// Lanes `Sel` of a and c (per 128-bit half: two of a, then two of c).
template <int Sel>
AVX2_FN inline __m256i pick(__m256i a, __m256i c) {
  return _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(c), Sel));
}

// 32 int32 codes (4 vectors of 8 columns) as int16, even columns then odd
// (packs saturates a low code of exactly +-32768 to +-32767).
AVX2_FN inline void store_deinterleaved(const __m256i i[4], int16_t* c, __m256i order) {
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m256i ev = _mm256_packs_epi32(pick<even>(i[0], i[1]), pick<even>(i[2], i[3]));
  const __m256i od = _mm256_packs_epi32(pick<odd>(i[0], i[1]), pick<odd>(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), _mm256_permutevar8x32_epi32(ev, order));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 16), _mm256_permutevar8x32_epi32(od, order));
}

// As quantize_scalar, 8 columns per instruction: cvtps rounds to nearest
// even like lrint. The even (odd) columns of a block's 4 int32 vectors are
// gathered by shuffle_ps and packs into 64-bit chunks out of order, put back
// in order by one lane permutation.
AVX2_FN void quantize_avx2(const float* x, int64_t cols, Int16Activations& out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + 32 * b;
    const __m256 f0 = _mm256_loadu_ps(xb), f1 = _mm256_loadu_ps(xb + 8), f2 = _mm256_loadu_ps(xb + 16),
                 f3 = _mm256_loadu_ps(xb + 24);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f0), _mm256_andnot_ps(sign, f1)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, f2), _mm256_andnot_ps(sign, f3)));
    const float amax = hmax(m);
    const __m256 inv = _mm256_set1_ps(amax > 0 ? kCodeMax / amax : 0.0f);
    int16_t* c = out.code.data() + 64 * b;
    const __m256 f[4] = {f0, f1, f2, f3};
    __m256i hi[4], lo[4];
    for (int k = 0; k < 4; ++k) {
      hi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(f[k], inv));
      const __m256 rest = _mm256_fmsub_ps(f[k], inv, _mm256_cvtepi32_ps(hi[k]));
      lo[k] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(kLoSteps)));
    }
    store_deinterleaved(hi, c, order);
    store_deinterleaved(lo, c + 32, order);
    out.scale[size_t(b)] = amax / kCodeMax;
    out.sum[size_t(b)] = hsum8(_mm256_add_ps(_mm256_add_ps(f0, f1), _mm256_add_ps(f2, f3)));
  }
}

AVX2_FN inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K: the 12 bytes of 6-bit (scale, min) pairs unpacked to 8 scales
// (bytes 0-7) and 8 mins (bytes 8-15), ggml's bit layout.
inline void k_scales_mins(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
  u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  u[2] = mins_lo;
  u[0] &= 0x3f3f3f3fu;
  std::memcpy(out, u, 16);
}

namespace avx2 {
#define I16_FN AVX2_FN
#define I16_VNNI 0
#include "core/block_quant_i16_kernels.inc"
#undef I16_FN
#undef I16_VNNI
}  // namespace avx2

namespace vnni {
#define I16_FN VNNI_FN
#define I16_VNNI 1
#include "core/block_quant_i16_kernels.inc"
#undef I16_FN
#undef I16_VNNI
}  // namespace vnni
#endif

}  // namespace

void quantize_activations_i16(const float* x, int64_t cols, Int16Activations& out) {
  quantize_activations_i16_at(cpu_level(), x, cols, out);
}

void quantize_activations_i16_at(CpuLevel level, const float* x, int64_t cols, Int16Activations& out) {
  if (cols <= 0 || cols % 32 != 0)
    fail("quantize_activations_i16: " + std::to_string(cols) + " columns is not a whole number of blocks of 32");
  out.cols = cols;
  out.code.resize(size_t(2 * cols));
  out.scale.resize(size_t(cols / 32));
  out.sum.resize(size_t(cols / 32));
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx2) return quantize_avx2(x, cols, out);
#endif
  (void)level;
  quantize_scalar(x, cols, out);
}

bool block_dot_i16_supported(CpuLevel level, QuantKind q) {
#ifdef FLASHMOE_X86
  return level >= CpuLevel::Avx2 && (q == QuantKind::Q4_K || q == QuantKind::Q6_K || q == QuantKind::Q8_0 ||
                                   q == QuantKind::Q5_0);
#else
  (void)level;
  (void)q;
  return false;
#endif
}

namespace {

void check_i16(CpuLevel level, const Matrix& W, const Int16Activations& x) {
  if (!block_dot_i16_supported(level, W.quant) || x.cols != W.cols || W.cols % block_elems(W.quant) != 0)
    fail(std::string("block_dot_row_i16: not available at level ") + cpu_level_name(level) + " for a " +
         quant_name(W.quant) + " matrix of " + std::to_string(W.cols) + " columns against " + std::to_string(x.cols) +
         " activations");
}

}  // namespace

void block_dot_rows_i16_at(CpuLevel level, const Matrix& W, int64_t r0, int64_t r1, const Int16Activations& x,
                           float* y) {
  check_i16(level, W, x);
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx512Vnni) switch (W.quant) {
      case QuantKind::Q8_0: return vnni::rows<vnni::dot_q8_0>(W, r0, r1, x, y);
      case QuantKind::Q4_K: return vnni::rows<vnni::dot_q4_k>(W, r0, r1, x, y);
      case QuantKind::Q5_0: return vnni::rows<vnni::dot_q5_0>(W, r0, r1, x, y);
      default: return vnni::rows<vnni::dot_q6_k>(W, r0, r1, x, y);
    }
  switch (W.quant) {
    case QuantKind::Q8_0: return avx2::rows<avx2::dot_q8_0>(W, r0, r1, x, y);
    case QuantKind::Q4_K: return avx2::rows<avx2::dot_q4_k>(W, r0, r1, x, y);
    case QuantKind::Q5_0: return avx2::rows<avx2::dot_q5_0>(W, r0, r1, x, y);
    default: return avx2::rows<avx2::dot_q6_k>(W, r0, r1, x, y);
  }
#else
  (void)r0, (void)r1, (void)y;
#endif
}

float block_dot_row_i16_at(CpuLevel level, const Matrix& W, int64_t r, const Int16Activations& x) {
  float y[1];
  block_dot_rows_i16_at(level, W.slice_rows(r, 1), 0, 1, x, y);
  return y[0];
}

}  // namespace flashmoe::cpu
