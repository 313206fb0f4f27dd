// The fused AVX2 form of gated_delta_step (gated_delta.h), the AVX-512 one's
// (gated_delta_avx512.cpp) on 8 lanes: the delta m and the output o stay in
// registers across the dk rows of the state. Compiled per function by its
// target attribute.
#include "backend/cpu/gated_delta.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define DELTA_AVX2_FN __attribute__((target("avx2,fma")))

namespace flashmoe::cpu {

namespace {

// NV = dv / 8 vectors per row. The row-by-row form's operations in its
// order (row *= decay; m += k_i row; m = beta (v - m); row += k_i m;
// o += q_i row), each a per-element multiply or multiply-add, so the bits
// agree with it at the avx2 and avx512 levels (whose axpy is a
// multiply-add).
template <int NV>
DELTA_AVX2_FN void fused8(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                         int64_t dk, float* out) {
  constexpr int64_t dv = NV * 8;
  const __m256 dec = _mm256_set1_ps(decay);
  __m256 m[NV], o[NV];
  for (int j = 0; j < NV; ++j) m[j] = o[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const __m256 ki = _mm256_set1_ps(k[i]);
    for (int j = 0; j < NV; ++j) {
      const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * j), dec);
      _mm256_storeu_ps(row + 8 * j, r);
      m[j] = _mm256_fmadd_ps(ki, r, m[j]);
    }
  }
  const __m256 b = _mm256_set1_ps(beta);
  for (int j = 0; j < NV; ++j) m[j] = _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(v + 8 * j), m[j]));
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    for (int j = 0; j < NV; ++j) {
      const __m256 r = _mm256_fmadd_ps(ki, m[j], _mm256_loadu_ps(row + 8 * j));
      _mm256_storeu_ps(row + 8 * j, r);
      o[j] = _mm256_fmadd_ps(qi, r, o[j]);
    }
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, o[j]);
}

}  // namespace

bool gated_delta_step_fused_avx2(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                                 int64_t dk, int64_t dv, float* out) {
  switch (dv) {
    case 32: fused8<4>(S, q, k, v, decay, beta, dk, out); return true;
    case 64: fused8<8>(S, q, k, v, decay, beta, dk, out); return true;
    default: return false;  // 128: sixteen m and o vectors do not fit the 16 registers
  }
}

}  // namespace flashmoe::cpu

#undef DELTA_AVX2_FN

#else

namespace flashmoe::cpu {
bool gated_delta_step_fused_avx2(float*, const float*, const float*, const float*, float, float, int64_t, int64_t,
                                 float*) {
  return false;
}
}  // namespace flashmoe::cpu

#endif
