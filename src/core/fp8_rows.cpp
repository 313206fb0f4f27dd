#include "core/fp8_rows.h"

#include <algorithm>

#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "core/x86_hsum.h"
#define FLASHMOE_X86 1
#define AVX2_FN __attribute__((target("avx2,fma")))
#endif

namespace flashmoe::cpu::fp8_rows {

namespace {
const uint8_t* row_ptr(const Matrix& W, int64_t r) { return static_cast<const uint8_t*>(W.data) + size_t(r) * W.cols; }
}  // namespace

void dequant_portable(const Matrix& W, int64_t r, float* out) {
  const uint8_t* q = row_ptr(W, r);
  for (int64_t b = 0, c0 = 0; c0 < W.cols; ++b, c0 += W.group) {
    const float s = W.block_scale(r, b);
    const int64_t c1 = std::min<int64_t>(W.cols, c0 + W.group);
    for (int64_t c = c0; c < c1; ++c) out[c] = e4m3_value(q[c]) * s;
  }
}

// Within a block the codes times x are summed unscaled, then scaled once:
// one multiply per block instead of one per weight.
float dot_portable(const Matrix& W, int64_t r, const float* x) {
  const uint8_t* q = row_ptr(W, r);
  float acc = 0;
  for (int64_t b = 0, c0 = 0; c0 < W.cols; ++b, c0 += W.group) {
    const int64_t c1 = std::min<int64_t>(W.cols, c0 + W.group);
    float part = 0;
    for (int64_t c = c0; c < c1; ++c) part += e4m3_value(q[c]) * x[c];
    acc += part * W.block_scale(r, b);
  }
  return acc;
}

#ifdef FLASHMOE_X86
namespace {
// Eight E4M3 codes as fp32, exactly: normal codes by moving the exponent and
// mantissa into fp32's fields (bias 7 -> 127), subnormals (exponent 0) as
// m * 2^-9, the sign bit last. No fp32 denormal is formed, so the result
// does not depend on the FTZ / DAZ modes.
AVX2_FN inline __m256 decode8(const uint8_t* q) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(7))), _mm256_set1_ps(1.0f / 512.0f));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
  const __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, _mm256_castsi256_ps(is_sub));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

}  // namespace

AVX2_FN void dequant_avx2(const Matrix& W, int64_t r, float* out) {
  const uint8_t* q = row_ptr(W, r);
  for (int64_t b = 0, c0 = 0; c0 < W.cols; ++b, c0 += W.group) {
    const float s = W.block_scale(r, b);
    const int64_t c1 = std::min<int64_t>(W.cols, c0 + W.group);
    const __m256 vs = _mm256_set1_ps(s);
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(out + c, _mm256_mul_ps(decode8(q + c), vs));
    for (; c < c1; ++c) out[c] = e4m3_value(q[c]) * s;
  }
}

AVX2_FN float dot_avx2(const Matrix& W, int64_t r, const float* x) {
  const uint8_t* q = row_ptr(W, r);
  __m256 acc = _mm256_setzero_ps();
  float tail = 0;
  for (int64_t b = 0, c0 = 0; c0 < W.cols; ++b, c0 += W.group) {
    const int64_t c1 = std::min<int64_t>(W.cols, c0 + W.group);
    const float s = W.block_scale(r, b);
    __m256 p0 = _mm256_setzero_ps(), p1 = p0;
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
      p0 = _mm256_fmadd_ps(decode8(q + c), _mm256_loadu_ps(x + c), p0);
      p1 = _mm256_fmadd_ps(decode8(q + c + 8), _mm256_loadu_ps(x + c + 8), p1);
    }
    for (; c + 8 <= c1; c += 8) p0 = _mm256_fmadd_ps(decode8(q + c), _mm256_loadu_ps(x + c), p0);
    float t = 0;
    for (; c < c1; ++c) t += e4m3_value(q[c]) * x[c];
    acc = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(s), acc);
    tail += t * s;
  }
  return hsum8(acc) + tail;
}
#else
void dequant_avx2(const Matrix& W, int64_t r, float* out) { dequant_portable(W, r, out); }
float dot_avx2(const Matrix& W, int64_t r, const float* x) { return dot_portable(W, r, x); }
#endif

}  // namespace flashmoe::cpu::fp8_rows
