// q8 / q4 group-wise quantisation: error bounds, kernels against the
// dequantised reference, and MLX-layout checkpoints loading.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/cpu/matmul.h"
#include "core/error.h"
#include "core/matrix_rows.h"
#include "core/xxhash64.h"
#include <cstring>
#include "experts/quantize.h"
#include "experts_test_util.h"

namespace experts_quant_test {

using namespace flashmoe;

namespace {

std::vector<float> random_matrix(int64_t rows, int64_t cols, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> w(size_t(rows * cols));
  for (auto& x : w) x = d(rng);
  // A few outliers and a constant group, the cases that stress scale and bias.
  w[5] = 8.0f * scale;
  w[size_t(cols) + 3] = -7.0f * scale;
  for (int i = 0; i < 64; ++i) w[size_t(2 * cols) + i] = 0.25f;
  return w;
}

Matrix f32_view(const std::vector<float>& w, int64_t rows, int64_t cols) { return Matrix{DType::F32, w.data(), rows, cols}; }

}  // namespace

TEST(ExpertsQuant, Xxhash64KnownValues) {
  EXPECT_EQ(xxhash64("", 0), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(xxhash64("a", 1), 0xD24EC4F1A98C6E5Bull);
  EXPECT_EQ(xxhash64("abc", 3), 0x44BC2CF5AD770999ull);
}

TEST(ExpertsQuant, RoundTripErrorWithinHalfAStep) {
  const int64_t rows = 8, cols = 256, G = 64;
  std::vector<float> w = random_matrix(rows, cols, 1);
  for (QuantKind k : {QuantKind::Q8, QuantKind::Q4}) {
    QuantizedMatrix q = quantize_matrix(f32_view(w, rows, cols), k, G);
    const int levels = (1 << quant_bits(k)) - 1;
    std::vector<float> row(cols);
    double worst_ratio = 0;
    for (int64_t r = 0; r < rows; ++r) {
      cpu::load_row(q.view(), r, row.data());
      for (int64_t g = 0; g < cols / G; ++g) {
        float lo = 1e30f, hi = -1e30f;
        for (int64_t c = g * G; c < (g + 1) * G; ++c) lo = std::min(lo, w[r * cols + c]), hi = std::max(hi, w[r * cols + c]);
        // Half a quantisation step, plus the bf16 rounding of bias (2^-9 relative)
        // and of the step (at most one bf16 ulp, 2^-7 relative, over all levels).
        const float step = (hi - lo) / levels;
        const float bound = 0.5f * step * (1 + 1.0f / 64) + std::fabs(lo) * 0x1p-8f + (hi - lo) * 0x1p-7f + 1e-7f;
        for (int64_t c = g * G; c < (g + 1) * G; ++c) {
          const float err = std::fabs(row[c] - w[r * cols + c]);
          ASSERT_LE(err, bound) << quant_name(k) << " r=" << r << " c=" << c;
          if (step > 0) worst_ratio = std::max(worst_ratio, double(err / step));
        }
      }
    }
    EXPECT_LE(worst_ratio, 0.55) << quant_name(k);  // essentially half a step
  }
}

TEST(ExpertsQuant, Q4PackingIsMlxLayout) {
  // Codes 0..15 repeated: uint32 word j must read 0x76543210 / 0xFEDCBA98 (lowest nibble first).
  std::vector<float> w(64);
  for (int i = 0; i < 64; ++i) w[i] = float(i % 16);
  QuantizedMatrix q = quantize_matrix(f32_view(w, 1, 64), QuantKind::Q4, 64);
  EXPECT_EQ(bf16_to_f32(q.scales[0]), 1.0f);
  EXPECT_EQ(bf16_to_f32(q.biases[0]), 0.0f);
  uint32_t words[2];
  std::memcpy(words, q.data.data(), 8);
  EXPECT_EQ(words[0], 0x76543210u);
  EXPECT_EQ(words[1], 0xFEDCBA98u);
}

TEST(ExpertsQuant, MatmulEqualsDequantisedF32Matmul) {
  const int64_t rows = 37, cols = 320;
  std::vector<float> w = random_matrix(rows, cols, 2, 0.05f);
  std::mt19937 rng(3);
  std::normal_distribution<float> d;
  ThreadPool pool(2);
  for (QuantKind k : {QuantKind::Q8, QuantKind::Q4}) {
    QuantizedMatrix q = quantize_matrix(f32_view(w, rows, cols), k, 64);
    std::vector<float> deq(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r) cpu::quant_dequant_row_at(CpuLevel::Portable, q.view(), r, deq.data() + r * cols);
    for (int64_t n : {1, 3, 8}) {
      std::vector<float> x(size_t(n * cols)), yq(size_t(n * rows)), yf(size_t(n * rows));
      for (auto& v : x) v = d(rng);
      cpu::matmul(pool, q.view(), x.data(), n, yq.data());
      cpu::matmul(pool, f32_view(deq, rows, cols), x.data(), n, yf.data());
      // One token at the AVX512-VNNI level is an int8 product against the
      // token quantised per group: off by at most what rounding the token
      // allows, sum_g scale_g / 2 * sum_c |w_c - b_g| (= |s_g| q_c).
      const bool int8 = n == 1 && cpu::int8_dot_supported(cpu_level(), q.view());
      cpu::Int8Activations xq;
      if (int8) cpu::quantize_activations(x.data(), cols, 64, xq);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < rows; ++r) {
          // Relative to the size of the terms summed, so cancellation cannot hide an error.
          double mag = 0, bound = 0;
          for (int64_t c = 0; c < cols; ++c) mag += std::fabs(deq[r * cols + c] * x[t * cols + c]);
          if (int8)
            for (int64_t c = 0; c < cols; ++c)
              bound += xq.scale[size_t(c / 64)] / 2 *
                       std::fabs(deq[r * cols + c] - bf16_to_f32(q.view().biases[r * (cols / 64) + c / 64]));
          ASSERT_LE(std::fabs(yq[t * rows + r] - yf[t * rows + r]), bound + 1e-5 * mag) << quant_name(k) << " n=" << n;
          if (n == 1) {
            ASSERT_LE(std::fabs(cpu::quant_dot_row_at(CpuLevel::Portable, q.view(), r, x.data()) - yf[r]), 1e-5 * mag);
          }
        }
    }
  }
}

TEST(ExpertsQuant, RejectsGroupThatDoesNotDivide) {
  std::vector<float> w(100, 1.0f);
  EXPECT_THROW(quantize_matrix(f32_view(w, 1, 100), QuantKind::Q4, 64), flashmoe::Error);
}

}  // namespace experts_quant_test
