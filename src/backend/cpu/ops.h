// Element-wise and per-vector ops of the forward pass, all in fp32.
#pragma once
#include <cmath>
#include <cstdint>

namespace flashmoe::cpu {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// torch.nn.functional.softplus with its default threshold of 20.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w). In place allowed.
void rmsnorm_zc(const float* x, const float* w, int64_t n, float eps, float* y);
// Plain-weight RMSNorm gated by silu(z): y = x * rsqrt(mean(x^2) + eps) * w * silu(z);
// y must be neither x nor z (it holds silu(z) first, from simd::silu).
void rmsnorm_gated(const float* x, const float* w, const float* z, int64_t n, float eps, float* y);
// x *= rsqrt(sum(x^2) + eps) * extra_scale
void l2norm(float* x, int64_t n, float eps, float extra_scale);
// NeoX (rotate-half) rotary on the first rd dims of x, with cos/sin of rd/2.
void rope_neox(float* x, int64_t rd, const float* cos, const float* sin);
// In-place softmax of n values; returns nothing.
void softmax(float* x, int64_t n);

}  // namespace flashmoe::cpu
