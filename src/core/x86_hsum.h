#pragma once
// The horizontal sum of eight floats that the x86 row kernels of core/
// (bf16/f32 rows, FP8 rows, GGUF blocks, their int16 and VNNI variants) end
// each dot product with: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). One
// definition, so the levels cannot drift apart in their summation order.
// Its target is plain AVX, a subset of every kernel level's target, so GCC
// inlines it into each of them.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace flashmoe::cpu {

__attribute__((target("avx"))) inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

}  // namespace flashmoe::cpu
#endif
