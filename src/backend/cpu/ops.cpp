#include "backend/cpu/ops.h"

#include <algorithm>

#include "core/simd.h"

namespace flashmoe::cpu {

void rmsnorm_zc(const float* x, const float* w, int64_t n, float eps, float* y) {
  float ss = simd::dot_f32(x, x, n);
  float r = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * (1.0f + w[i]);
}

void rmsnorm_gated(const float* x, const float* w, const float* z, int64_t n, float eps, float* y) {
  float ss = simd::dot_f32(x, x, n);
  float r = 1.0f / std::sqrt(ss / float(n) + eps);
  // silu(z) first, in y (y is neither x nor z), by the vector kernel.
  std::copy(z, z + n, y);
  simd::silu(y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i] * y[i];
}

void l2norm(float* x, int64_t n, float eps, float extra_scale) {
  float ss = simd::dot_f32(x, x, n);
  float r = extra_scale / std::sqrt(ss + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

void rope_neox(float* x, int64_t rd, const float* cos, const float* sin) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

void softmax(float* x, int64_t n) {
  float mx = *std::max_element(x, x + n);
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
  for (int64_t i = 0; i < n; ++i) x[i] /= sum;
}

}  // namespace flashmoe::cpu
