// Kernels of the KV cache's attention (kv_cache.cpp): FP8 K/V rows widened to
// fp32, the softmax's exponentials, the weighted sum of value rows; each with
// an AVX2 path chosen at run time (core/cpu_features.h).
#pragma once
#include <cstdint>

namespace flashmoe::kv_kernels {

// out[i] = value(src[i]) * scale, value() the OCP E4M3 decoding (NaN codes
// stay NaN). The product is rounded once, as decode(c) * scale in fp32.
void fp8_e4m3_to_f32(const uint8_t* src, int64_t n, float scale, float* out);

// out[i] = value(src[i]) * scale + offset[i] (fp8 `channel` rows: a
// per-channel offset); the AVX2 path rounds the product, then the sum, and
// the portable one may fuse them: the two agree to 1 ulp of the product.
void fp8_e4m3_to_f32_offset(const uint8_t* src, int64_t n, float scale, const float* offset, float* out);

// In place: x[i] = exp(x[i] - max) for i < n; returns the sum. Accurate to a
// few ulp (AVX2 polynomial) so softmax stays within 1e-6 relative.
float exp_shifted_sum(float* x, int64_t n, float max);

// out[i] += sum_{r < nrows} w[r] * rows[r * ld + i] for i < n: the weighted sum
// of a tile of value rows, kept in registers across the rows.
void weighted_rows_acc(const float* rows, int64_t ld, const float* w, int64_t nrows, float* out, int64_t n);

// weighted_rows_acc for `heads` query heads reading the same rows at once:
// out[h * n + i] += sum_r w[h * wstride + r] * rows[r * ld + i]. Each row is
// loaded once for all the heads; every element gets the same multiply-adds
// in the same order as weighted_rows_acc of its head alone (AVX-512 when the
// level allows and n is a multiple of 16, one lane per element either way).
void weighted_rows_acc_heads(const float* rows, int64_t ld, const float* w, int64_t wstride, int64_t heads,
                             int64_t nrows, float* out, int64_t n);

// In place: x = H x / sqrt(n), H the Sylvester Hadamard matrix of order n
// (a power of two). Orthonormal and its own inverse.
void hadamard_ortho(float* x, int64_t n);

}  // namespace flashmoe::kv_kernels
