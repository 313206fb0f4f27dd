// The fused AVX-512 form of gated_delta_step (gated_delta.h): the delta m and
// the output o stay in registers across the dk rows of the state, instead of
// three vector calls per row. Compiled per function by its target attribute.
#include "backend/cpu/gated_delta.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 intrinsics trip -Wuninitialized (see core/simd_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

namespace flashmoe::cpu {

namespace {

// NV = dv / 16 vectors per row. The same operations, in the same order, as
// gated_delta_step_rows at the avx512 level (row *= decay; m += k_i row;
// m = beta (v - m); row += k_i m; o += q_i row), so the bits agree.
template <int NV>
AVX512_FN void fused(float* S, const float* q, const float* k, const float* v, float decay, float beta, int64_t dk,
                     float* out) {
  constexpr int64_t dv = NV * 16;
  const __m512 dec = _mm512_set1_ps(decay);
  __m512 m[NV], o[NV];
  for (int j = 0; j < NV; ++j) m[j] = o[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const __m512 ki = _mm512_set1_ps(k[i]);
    for (int j = 0; j < NV; ++j) {
      const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * j), dec);
      _mm512_storeu_ps(row + 16 * j, r);
      m[j] = _mm512_fmadd_ps(ki, r, m[j]);
    }
  }
  const __m512 b = _mm512_set1_ps(beta);
  for (int j = 0; j < NV; ++j) m[j] = _mm512_mul_ps(b, _mm512_sub_ps(_mm512_loadu_ps(v + 16 * j), m[j]));
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
    for (int j = 0; j < NV; ++j) {
      const __m512 r = _mm512_fmadd_ps(ki, m[j], _mm512_loadu_ps(row + 16 * j));
      _mm512_storeu_ps(row + 16 * j, r);
      o[j] = _mm512_fmadd_ps(qi, r, o[j]);
    }
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + 16 * j, o[j]);
}

}  // namespace

bool gated_delta_step_fused_avx512(float* S, const float* q, const float* k, const float* v, float decay,
                                   float beta, int64_t dk, int64_t dv, float* out) {
  switch (dv) {
    case 32: fused<2>(S, q, k, v, decay, beta, dk, out); return true;
    case 64: fused<4>(S, q, k, v, decay, beta, dk, out); return true;
    case 128: fused<8>(S, q, k, v, decay, beta, dk, out); return true;
    default: return false;
  }
}

}  // namespace flashmoe::cpu

#else

namespace flashmoe::cpu {
bool gated_delta_step_fused_avx512(float*, const float*, const float*, const float*, float, float, int64_t, int64_t,
                                   float*) {
  return false;
}
}  // namespace flashmoe::cpu

#endif
