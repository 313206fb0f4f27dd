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
//
// Layouts. H is kept per sequence (it is what the cache has to remember), so
// it is stored as its packed lower triangle, d (d + 1) / 2 floats: element
// (i, j), j <= i, at i (i + 1) / 2 + j (H is symmetric; the Cholesky reads
// only that triangle). L is working memory, recomputed from H whenever
// queries were added, and kept as a full row-major d x d float matrix
// (zeros above the diagonal) so that the walk's update of the not yet
// rounded elements, sum_{j>i} L_ji e_j for every i < j, is one contiguous
// axpy over row j's first j entries per element (vectorised), not a strided
// column read per element.
#pragma once
#include <cstdint>
#include <vector>

namespace flashmoe::fp8 {

// Floats of a packed lower triangle of a d x d symmetric matrix.
constexpr int64_t packed_triangle(int64_t d) { return d * (d + 1) / 2; }

// Hp += q q^T (Hp: packed lower triangle, see above).
void add_outer_product(float* Hp, const float* q, int64_t d);

// L (d x d, row-major, lower, float) with L L^T = H + damp * (trace(H) / d) I,
// factored in double from the packed triangle Hp. The damping keeps L
// invertible where the queries seen so far span fewer than d directions
// (later queries may look there). Returns false (L untouched) when trace(H)
// is 0: no query seen yet.
bool damped_cholesky(const float* Hp, int64_t d, double damp, std::vector<float>& L);

// e^T (L L^T) e for e = x - scale * decode(code). The same additions in the
// same order as e4m3_encode_qk's own error, so the two agree to the bit.
double qk_error(const float* x, const uint8_t* code, int64_t d, float scale, const float* L);

// The codes of x / scale (d elements) chosen by the error feedback above
// through L (from damped_cholesky); of those and the nearest codes, the
// ones with the smaller qk_error are written to out (so never worse than
// rounding to nearest under L L^T); returns their qk_error.
double e4m3_encode_qk(const float* x, int64_t d, float scale, const float* L, uint8_t* out);

// fp8 `channel` keys: of the kE4m3ScaleCandidates scales, each rounded to
// f24 (fp8::e4m3_scale_candidate_f24: `channel` stores its key scales so,
// and the codes are chosen for the scale decoding will use), the one
// whose e4m3_encode_qk codes have the least qk_error (ties: the earlier);
// writes those codes to out and returns the scale (1, all codes 0, when x is
// 0). The least-squares scale of e4m3_mse_scale minimises e^T e, which is
// not what the queries read.
float e4m3_encode_qk_best_scale(const float* x, int64_t d, const float* L, uint8_t* out);

}  // namespace flashmoe::fp8
