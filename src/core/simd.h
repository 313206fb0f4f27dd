// Vector kernels with an AVX2/FMA path chosen at run time and a portable
// fallback, so one binary runs on any x86-64 (and builds elsewhere).
#pragma once
#include <cstdint>

#include "core/cpu_features.h"
#include "core/dtype.h"

namespace flashmoe::cpu::simd {

// Whether the AVX2 paths are taken (core/cpu_features.h).
inline bool has_avx2() { return avx2_available(); }

// Widens n elements of type t to fp32.
void to_f32(DType t, const void* src, int64_t n, float* out);
// sum_i w[i] * x[i] where w is stored as type t.
float dot_mixed(DType t, const void* w, const float* x, int64_t n);
float dot_f32(const float* a, const float* b, int64_t n);
// out[k] = dot(row k, x) for 4 rows of type t, `stride` bytes apart: x is
// loaded once for all four, the decode matvec's inner loop.
void dot4_mixed(DType t, const void* w, size_t stride, const float* x, int64_t n, float out[4]);
// out[k] = dot(a + k*lda, x) for k in 0..3.
void dot4_f32(const float* a, int64_t lda, const float* x, int64_t n, float out[4]);
// y += alpha * x
void axpy(float alpha, const float* x, float* y, int64_t n);

}  // namespace flashmoe::cpu::simd
