// The GatedDeltaNet recurrence of one value head for one token:
//   S <- exp(g) S;  m = S^T k;  S <- S + k (beta (v - m))^T;  o = S^T q
// with S in R^{dk x dv} row-major (row i belongs to key dimension i).
#pragma once
#include <cstdint>

namespace flashmoe::cpu {

void gated_delta_step(float* S, const float* q, const float* k, const float* v, float decay,
                      float beta, int64_t dk, int64_t dv, float* out, float* scratch_dv);

}  // namespace flashmoe::cpu
