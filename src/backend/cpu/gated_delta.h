// The GatedDeltaNet recurrence of one value head for one token:
//   S <- exp(g) S;  m = S^T k;  S <- S + k (beta (v - m))^T;  o = S^T q
// with S in R^{dk x dv} row-major (row i belongs to key dimension i).
#pragma once
#include <cstdint>

namespace flashmoe::cpu {

// At the avx512 level with dv of 32, 64 or 128, one fused kernel keeps m and
// o in registers (gated_delta_avx512.cpp); otherwise row-by-row vector
// kernels (core/simd). Both do the same multiply-adds in the same order.
void gated_delta_step(float* S, const float* q, const float* k, const float* v, float decay,
                      float beta, int64_t dk, int64_t dv, float* out, float* scratch_dv);

// The row-by-row form at the active level, whatever dv (the tests compare
// the fused kernel with it bit for bit).
void gated_delta_step_rows(float* S, const float* q, const float* k, const float* v, float decay,
                           float beta, int64_t dk, int64_t dv, float* out, float* scratch_dv);

// The fused AVX-512 kernel; false (nothing done) where it does not apply
// (another level, or dv not 32, 64 or 128).
bool gated_delta_step_fused(float* S, const float* q, const float* k, const float* v, float decay,
                            float beta, int64_t dk, int64_t dv, float* out);

}  // namespace flashmoe::cpu
