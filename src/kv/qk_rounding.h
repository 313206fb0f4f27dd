// FP8 E4M3 roundings of one key chosen for the error of q.k rather than of k.
//
// A key k (already centered: the stored value is x = k - z, decoded as
// z + s decode(code)) is read by every later query only through q.k, so the
// error that matters is E_q[(q.e)^2] = e^T H e, e = x - s decode(code), H the
// second moment of the queries that read it. Rounding each element to its
// nearest code minimises e^T e, not e^T H e. Here the elements are rounded
// one at a time with the errors already made pushed onto the elements not
// yet rounded (GPTQ's error feedback; on one vector it is Babai's nearest
// plane): with H = L L^T, e^T H e = |L^T e|^2 and (L^T e)_i depends on e_j,
// j >= i only, so walking i = d-1 .. 0 each element is rounded from
// x_i + (sum_{j>i} L_ji e_j) / L_ii, which leaves |(L^T e)_i| at most L_ii
// times half a code step: the error goes where the queries do not look.
#pragma once
#include <cstdint>
#include <vector>

namespace flashmoe::fp8 {

// H += q q^T (d x d, row-major; both triangles).
void add_outer_product(float* H, const float* q, int64_t d);

// L (d x d, row-major, lower) with L L^T = H + damp * (trace(H) / d) I, in
// double. The damping keeps L invertible where the queries seen so far span
// fewer than d directions (later queries may look there). Returns false
// (L untouched) when trace(H) is 0: no query seen yet.
bool damped_cholesky(const float* H, int64_t d, double damp, std::vector<double>& L);

// e^T (L L^T) e for e = x - scale * decode(code).
double qk_error(const float* x, const uint8_t* code, int64_t d, float scale, const std::vector<double>& L);

// The codes of x / scale (d elements) chosen by the error feedback above
// through L (from damped_cholesky); of those and the nearest codes, the
// ones with the smaller qk_error are written to out (so never worse than
// rounding to nearest under L L^T); returns their qk_error.
double e4m3_encode_qk(const float* x, int64_t d, float scale, const std::vector<double>& L, uint8_t* out);

// fp8 `channel` keys: of the kE4m3ScaleCandidates scales, the one whose
// e4m3_encode_qk codes have the least qk_error (ties: the earlier); writes
// those codes to out and returns the scale (1, all codes 0, when x is 0).
// The least-squares scale of e4m3_mse_scale minimises e^T e, which is not
// what the queries read.
float e4m3_encode_qk_best_scale(const float* x, int64_t d, const std::vector<double>& L, uint8_t* out);

}  // namespace flashmoe::fp8
