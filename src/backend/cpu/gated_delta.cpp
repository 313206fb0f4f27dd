#include "backend/cpu/gated_delta.h"

#include <algorithm>

#include "core/cpu_features.h"
#include "core/simd.h"

namespace flashmoe::cpu {

void gated_delta_step_rows(float* S, const float* q, const float* k, const float* v, float decay,
                           float beta, int64_t dk, int64_t dv, float* out, float* m) {
  // Pass 1: decay the state and read the memory for key k.
  std::fill(m, m + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) row[j] *= decay;
    simd::axpy(k[i], row, m, dv);
  }
  for (int64_t j = 0; j < dv; ++j) m[j] = beta * (v[j] - m[j]);  // the delta
  // Pass 2: write the delta at k and read the output at q.
  std::fill(out, out + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    simd::axpy(k[i], m, row, dv);
    simd::axpy(q[i], row, out, dv);
  }
}

bool gated_delta_step_fused_at(CpuLevel level, float* S, const float* q, const float* k, const float* v,
                               float decay, float beta, int64_t dk, int64_t dv, float* out) {
  if (level >= CpuLevel::Avx512) return gated_delta_step_fused_avx512(S, q, k, v, decay, beta, dk, dv, out);
  if (level == CpuLevel::Avx2) return gated_delta_step_fused_avx2(S, q, k, v, decay, beta, dk, dv, out);
  return false;
}

void gated_delta_step(float* S, const float* q, const float* k, const float* v, float decay,
                      float beta, int64_t dk, int64_t dv, float* out, float* m) {
  if (gated_delta_step_fused_at(cpu_level(), S, q, k, v, decay, beta, dk, dv, out)) return;
  gated_delta_step_rows(S, q, k, v, decay, beta, dk, dv, out, m);
}

}  // namespace flashmoe::cpu
