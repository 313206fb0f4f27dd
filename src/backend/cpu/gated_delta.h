// The GatedDeltaNet recurrence of one value head for one token:
//   S <- exp(g) S;  m = S^T k;  S <- S + k (beta (v - m))^T;  o = S^T q
// with S in R^{dk x dv} row-major (row i belongs to key dimension i).
#pragma once
#include <cstdint>

#include "core/cpu_features.h"

namespace flashmoe::cpu {

// At the avx512 level with dv of 32, 64 or 128, and at avx2 with dv of 32 or
// 64, one fused kernel keeps m and o in registers (gated_delta_avx512.cpp,
// gated_delta_avx2.cpp); otherwise row-by-row vector kernels (core/simd).
// Both do the same multiplies and multiply-adds per element in the same
// order, so the same bits.
void gated_delta_step(float* S, const float* q, const float* k, const float* v, float decay,
                      float beta, int64_t dk, int64_t dv, float* out, float* scratch_dv);

// The row-by-row form at the active level, whatever dv (the tests compare
// the fused kernel with it bit for bit).
void gated_delta_step_rows(float* S, const float* q, const float* k, const float* v, float decay,
                           float beta, int64_t dk, int64_t dv, float* out, float* scratch_dv);

// The fused kernel of `level`; false (nothing done) where none applies
// (the portable level, or a dv the level's kernel does not take).
bool gated_delta_step_fused_at(CpuLevel level, float* S, const float* q, const float* k, const float* v,
                               float decay, float beta, int64_t dk, int64_t dv, float* out);

// The per-level kernels behind it.
bool gated_delta_step_fused_avx512(float* S, const float* q, const float* k, const float* v, float decay,
                                   float beta, int64_t dk, int64_t dv, float* out);
bool gated_delta_step_fused_avx2(float* S, const float* q, const float* k, const float* v, float decay,
                                 float beta, int64_t dk, int64_t dv, float* out);

}  // namespace flashmoe::cpu
