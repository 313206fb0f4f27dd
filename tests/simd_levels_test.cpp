// Every instruction level's kernels that this CPU can run (core/simd.h,
// core/matrix_rows.h, the delta-rule step), against double-precision sums
// computed here: each level must give the same function, and within a level
// a row's dot product must be the same bits alone, four rows at a time, in
// the 4 x 4 prefill tile and from its fp32 widening (prefill and decode agree
// exactly; FP8 KV needs it), and in the prefill's panel of rows x tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "backend/cpu/gated_delta.h"
#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/matrix_rows.h"
#include "core/simd.h"

namespace simd_levels_test {

using namespace flashmoe;
namespace simd = flashmoe::cpu::simd;

namespace {

std::vector<CpuLevel> runnable_levels() {
  std::vector<CpuLevel> out;
  for (CpuLevel l : {CpuLevel::Portable, CpuLevel::Avx2, CpuLevel::Avx512, CpuLevel::Avx512Vnni})
    if (l <= cpu_level_supported()) out.push_back(l);
  return out;
}

struct Rows {
  std::vector<uint16_t> bf16, f16;
  std::vector<float> f32;  // the exact values of bf16
};

Rows random_rows(int64_t rows, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Rows r;
  for (int64_t i = 0; i < rows * n; ++i) {
    const float v = d(rng);
    r.bf16.push_back(f32_to_bf16(v));
    r.f16.push_back(f32_to_f16(v));
    r.f32.push_back(bf16_to_f32(r.bf16.back()));
  }
  return r;
}

double ref_dot(const float* a, const float* b, int64_t n, double* mag) {
  double s = 0, m = 0;
  for (int64_t i = 0; i < n; ++i) s += double(a[i]) * b[i], m += std::fabs(double(a[i]) * b[i]);
  *mag = m;
  return s;
}

}  // namespace

TEST(SimdLevels, DetectedLevelIsTheWidestUnlessForced) {
  EXPECT_LE(cpu_level(), cpu_level_supported());
  if (!std::getenv("FLASHMOE_CPU_LEVEL")) {
    EXPECT_EQ(cpu_level(), cpu_level_supported());
  }
  EXPECT_STREQ(cpu_level_name(CpuLevel::Avx512Vnni), "avx512vnni");
  EXPECT_STREQ(cpu_level_name(CpuLevel::Avx512), "avx512");
  EXPECT_STREQ(cpu_level_name(CpuLevel::Avx2), "avx2");
  EXPECT_STREQ(cpu_level_name(CpuLevel::Portable), "portable");
}

// Lengths around the vector widths (8, 16) exercise the tails and masks.
TEST(SimdLevels, EveryLevelComputesTheSameFunction) {
  std::mt19937 rng(7);
  for (CpuLevel level : runnable_levels()) {
    SCOPED_TRACE(cpu_level_name(level));
    const simd::Kernels& k = simd::kernels(level);
    for (int64_t n : {1, 7, 8, 15, 16, 17, 31, 33, 64, 100, 256}) {
      SCOPED_TRACE(n);
      Rows w = random_rows(4, n, rng);
      Rows x = random_rows(9, n, rng);
      // Widening is exact.
      std::vector<float> wide(size_t(4 * n), -1.0f);
      k.to_f32(DType::BF16, w.bf16.data(), 4 * n, wide.data());
      EXPECT_EQ(wide, w.f32);
      std::vector<float> hwide(size_t(4 * n));
      k.to_f32(DType::F16, w.f16.data(), 4 * n, hwide.data());
      for (int64_t i = 0; i < 4 * n; ++i) ASSERT_EQ(hwide[i], f16_to_f32(w.f16[i]));

      float d4[4], tile[16];
      k.dot4_mixed(DType::BF16, w.bf16.data(), size_t(n) * 2, x.f32.data(), n, d4);
      // Four rows against 1-9 tokens at once (every mix of tiles of four,
      // three, two and one): each output dot_mixed's bits (y's stride wider
      // than 4; cells past the rows stay untouched).
      for (int64_t tokens = 1; tokens <= 9; ++tokens) {
        std::vector<float> y4(size_t(tokens * 6), -7.0f);
        k.dot4xn_mixed(DType::BF16, w.bf16.data(), size_t(n) * 2, x.f32.data(), n, tokens, n, y4.data(), 6);
        for (int64_t j = 0; j < tokens; ++j)
          for (int r = 0; r < 6; ++r) {
            const float want = r < 4 ? k.dot_mixed(DType::BF16, w.bf16.data() + r * n, x.f32.data() + j * n, n) : -7.0f;
            ASSERT_EQ(y4[size_t(j * 6 + r)], want) << "tokens " << tokens << " token " << j << " row " << r;
          }
      }
      // The panel of fp32 rows, four rows against four tokens: one whole tile.
      k.dot_panel_f32(w.f32.data(), n, 4, x.f32.data(), n, 4, n, tile, 4);
      for (int r = 0; r < 4; ++r) {
        double mag = 0;
        const double ref = ref_dot(w.f32.data() + r * n, x.f32.data(), n, &mag);
        const float one = k.dot_mixed(DType::BF16, w.bf16.data() + r * n, x.f32.data(), n);
        EXPECT_NEAR(one, ref, 1e-6 * mag + 1e-30);
        // The same bits every way the row can be computed.
        EXPECT_EQ(one, d4[r]);
        EXPECT_EQ(one, k.dot_mixed(DType::F32, w.f32.data() + r * n, x.f32.data(), n));
        EXPECT_EQ(one, tile[r]);
        for (int j = 0; j < 4; ++j) {
          const double rj = ref_dot(w.f32.data() + r * n, x.f32.data() + j * n, n, &mag);
          EXPECT_NEAR(tile[4 * j + r], rj, 1e-6 * mag + 1e-30) << "row " << r << " token " << j;
          EXPECT_EQ(tile[4 * j + r], k.dot_mixed(DType::F32, w.f32.data() + r * n, x.f32.data() + j * n, n));
        }
        // f16 weights.
        std::vector<float> hrow(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) hrow[i] = f16_to_f32(w.f16[r * n + i]);
        const double href = ref_dot(hrow.data(), x.f32.data(), n, &mag);
        EXPECT_NEAR(k.dot_mixed(DType::F16, w.f16.data() + r * n, x.f32.data(), n), href, 1e-6 * mag + 1e-30);
      }
      std::vector<float> y(x.f32.begin(), x.f32.begin() + n);
      k.axpy(0.5f, w.f32.data(), y.data(), n);
      for (int64_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(y[i], x.f32[i] + 0.5f * w.f32[i]);
    }
  }
}

// The prefill's panel kernel (a block of fp32 rows against every token, in
// 4 x 4 register tiles, then the leftover tokens and rows) gives each output
// the bits of that row's and token's dot product alone, whatever the block's
// shape: the prefill (panels) and decode (one row at a time) agree exactly.
// Strides wider than n, and cells outside the panel must stay untouched.
TEST(SimdLevels, PanelKernelGivesEveryOutputItsDotProductBits) {
  std::mt19937 rng(5);
  for (CpuLevel level : runnable_levels()) {
    SCOPED_TRACE(cpu_level_name(level));
    const simd::Kernels& k = simd::kernels(level);
    for (int64_t n : {7, 16, 40, 64})
      for (int64_t rows : {1, 3, 4, 6, 16})
        for (int64_t tokens : {1, 2, 4, 5, 9}) {
          SCOPED_TRACE(testing::Message() << "n " << n << " rows " << rows << " tokens " << tokens);
          const int64_t lda = n + 3, ldx = n + 5, ldy = rows + 2;
          Rows a = random_rows(rows, lda, rng), x = random_rows(tokens, ldx, rng);
          std::vector<float> y(size_t(tokens * ldy), -7.0f);
          k.dot_panel_f32(a.f32.data(), lda, rows, x.f32.data(), ldx, tokens, n, y.data(), ldy);
          for (int64_t t = 0; t < tokens; ++t) {
            for (int64_t r = 0; r < rows; ++r) {
              const float one = k.dot_mixed(DType::F32, a.f32.data() + r * lda, x.f32.data() + t * ldx, n);
              ASSERT_EQ(y[size_t(t * ldy + r)], one) << "row " << r << " token " << t;
            }
            for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(y[size_t(t * ldy + r)], -7.0f);
          }
        }
  }
}

// The q8 / q4 row kernels of every level against the dequantised row in
// double precision (groups of 64 and of 24: the AVX-512 level takes groups
// that are a multiple of 16 and hands the others to AVX2).
TEST(SimdLevels, QuantisedRowsEveryLevel) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t rows = 3, cols = 192;
  for (int32_t group : {64, 24})
    for (QuantKind kind : {QuantKind::Q8, QuantKind::Q4}) {
      std::vector<uint8_t> data(size_t(rows * cols * quant_bits(kind) / 8));
      for (auto& b : data) b = uint8_t(byte(rng));
      std::vector<uint16_t> scales, biases;
      std::normal_distribution<float> d(0.0f, 0.1f);
      for (int64_t i = 0; i < rows * cols / group; ++i) {
        scales.push_back(f32_to_bf16(std::fabs(d(rng))));
        biases.push_back(f32_to_bf16(d(rng)));
      }
      Matrix W;
      W.rows = rows;
      W.cols = cols;
      W.dtype = DType::U8;
      W.quant = kind;
      W.group = group;
      W.data = data.data();
      W.scales = scales.data();
      W.biases = biases.data();
      std::vector<float> x(static_cast<size_t>(cols));
      for (auto& v : x) v = d(rng) * 10;
      for (CpuLevel level : runnable_levels()) {
        SCOPED_TRACE(std::string(cpu_level_name(level)) + " " + quant_name(kind) + " group " + std::to_string(group));
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<float> deq(static_cast<size_t>(cols));
          cpu::quant_dequant_row_at(level, W, r, deq.data());
          double dot = 0, mag = 0;
          for (int64_t c = 0; c < cols; ++c) {
            const int q = kind == QuantKind::Q8 ? data[r * cols + c]
                                                : (data[(r * cols + c) / 2] >> ((c & 1) * 4)) & 0xF;
            const double w = double(q) * bf16_to_f32(scales[(r * cols + c) / group]) +
                             bf16_to_f32(biases[(r * cols + c) / group]);
            ASSERT_NEAR(deq[c], w, 1e-6 * std::fabs(w) + 1e-7) << "c " << c;
            dot += w * x[c];
            mag += std::fabs(w * x[c]);
          }
          EXPECT_NEAR(cpu::quant_dot_row_at(level, W, r, x.data()), dot, 1e-5 * mag);
        }
      }
    }
}

// The int8 row dot (AVX512-VNNI level only; refused below it): against the
// same formula in double over the same activation codes (the kernel's own
// arithmetic), and against the exact fp32 dot within the bound that the
// activations' rounding allows (sum_g |s_g| scale_g / 2 sum_c q_c).
TEST(SimdLevels, Int8RowDotAtTheVnniLevel) {
  std::mt19937 rng(12);
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t rows = 5, cols = 256;
  for (int32_t group : {64, 32})
    for (QuantKind kind : {QuantKind::Q8, QuantKind::Q4}) {
      std::vector<uint8_t> data(size_t(rows * cols * quant_bits(kind) / 8));
      for (auto& b : data) b = uint8_t(byte(rng));
      std::vector<uint16_t> scales, biases;
      std::normal_distribution<float> d(0.0f, 0.1f);
      for (int64_t i = 0; i < rows * cols / group; ++i) {
        scales.push_back(f32_to_bf16(d(rng)));  // signed scales too
        biases.push_back(f32_to_bf16(d(rng)));
      }
      Matrix W;
      W.rows = rows;
      W.cols = cols;
      W.dtype = DType::U8;
      W.quant = kind;
      W.group = group;
      W.data = data.data();
      W.scales = scales.data();
      W.biases = biases.data();
      std::vector<float> x(static_cast<size_t>(cols));
      for (auto& v : x) v = d(rng) * 10;
      x[3] = 0;
      std::fill(x.begin() + group, x.begin() + 2 * group, 0.0f);  // an all-zero group: scale 0
      cpu::Int8Activations xq;
      cpu::quantize_activations(x.data(), cols, group, xq);
      for (CpuLevel level : runnable_levels()) {
        SCOPED_TRACE(std::string(cpu_level_name(level)) + " " + quant_name(kind) + " group " + std::to_string(group));
        EXPECT_EQ(cpu::int8_dot_supported(level, W), level >= CpuLevel::Avx512Vnni);
        if (!cpu::int8_dot_supported(level, W)) {
          EXPECT_THROW(cpu::quant_dot_row_int8_at(level, W, 0, xq), Error);
          continue;
        }
        for (int64_t r = 0; r < rows; ++r) {
          double same_codes = 0, exact = 0, bound = 0, mag = 0;
          for (int64_t g = 0; g < cols / group; ++g) {
            const double s = bf16_to_f32(scales[size_t(r * cols / group + g)]);
            const double b = bf16_to_f32(biases[size_t(r * cols / group + g)]);
            double qsum = 0;
            int64_t iq = 0;
            for (int64_t c = g * group; c < (g + 1) * group; ++c) {
              const int q = kind == QuantKind::Q8 ? data[size_t(r * cols + c)]
                                                  : (data[size_t((r * cols + c) / 2)] >> ((c & 1) * 4)) & 0xF;
              iq += int64_t(q) * xq.code[size_t(c)];
              qsum += q;
              exact += (q * s + b) * x[size_t(c)];
              mag += std::fabs((q * s + b) * x[size_t(c)]);
            }
            same_codes += s * xq.scale[size_t(g)] * double(iq) + b * xq.sum[size_t(g)];
            bound += std::fabs(s) * xq.scale[size_t(g)] / 2 * qsum;
          }
          const float got = cpu::quant_dot_row_int8_at(level, W, r, xq);
          EXPECT_NEAR(got, same_codes, 1e-5 * mag) << "row " << r;
          EXPECT_NEAR(got, exact, bound + 1e-5 * mag) << "row " << r;
          EXPECT_GT(std::fabs(got - exact), 0.0) << "row " << r << ": the int8 path was not taken";
        }
      }
    }
  std::vector<float> x(48);
  cpu::Int8Activations xq;
  EXPECT_THROW(cpu::quantize_activations(x.data(), 48, 32, xq), Error);
}

// The fused delta-rule steps (avx512, avx2) do the row-by-row form's
// operations in its order: the same bits, state and output (at the portable
// level, or another dv, gated_delta_step is the row-by-row form itself).
TEST(SimdLevels, FusedDeltaRuleStepMatchesRowByRow) {
  std::mt19937 rng(9);
  std::normal_distribution<float> d(0.0f, 0.5f);
  for (int64_t dv : {32, 64, 128, 48}) {
    SCOPED_TRACE(dv);
    const int64_t dk = 32;
    std::vector<float> S(static_cast<size_t>(dk * dv)), q(static_cast<size_t>(dk)), k(static_cast<size_t>(dk)),
        v(static_cast<size_t>(dv));
    for (auto* vec : {&S, &q, &k, &v})
      for (auto& x : *vec) x = d(rng);
    std::vector<float> S1 = S, S2 = S, o1(static_cast<size_t>(dv)), o2(static_cast<size_t>(dv)),
                       m(static_cast<size_t>(dv));
    for (int step = 0; step < 3; ++step) {
      cpu::gated_delta_step_rows(S1.data(), q.data(), k.data(), v.data(), 0.9f, 0.7f, dk, dv, o1.data(), m.data());
      cpu::gated_delta_step(S2.data(), q.data(), k.data(), v.data(), 0.9f, 0.7f, dk, dv, o2.data(), m.data());
    }
    EXPECT_EQ(S1, S2);
    EXPECT_EQ(o1, o2);
    // Each level's fused kernel on its own, where the CPU runs it, against
    // the row-by-row form above, whose axpy (the active level's) is a
    // multiply-add from avx2 up; the portable level's rounds the product
    // first, so under FLASHMOE_CPU_LEVEL=portable only which kernels apply
    // is checked.
    for (CpuLevel level : runnable_levels()) {
      SCOPED_TRACE(cpu_level_name(level));
      std::vector<float> S3 = S, o3(static_cast<size_t>(dv));
      bool fused = false;
      for (int step = 0; step < 3; ++step)
        fused = cpu::gated_delta_step_fused_at(level, S3.data(), q.data(), k.data(), v.data(), 0.9f, 0.7f, dk, dv,
                                               o3.data());
      const bool takes = dv != 48 && (level >= CpuLevel::Avx512 || (level == CpuLevel::Avx2 && dv != 128));
      EXPECT_EQ(fused, takes);
      if (!takes || cpu_level() < CpuLevel::Avx2) continue;
      EXPECT_EQ(S3, S1);
      EXPECT_EQ(o3, o1);
    }
  }
}

// Gate inputs over the range a gate takes and past it (exp under- and
// overflow), and factors to multiply them with.
struct GateInputs {
  std::vector<float> x, factor;
  GateInputs() {
    for (float v = -40.0f; v <= 40.0f; v += 0.0137f) x.push_back(v);
    for (float v : {-120.0f, -89.0f, -0.0f, 0.0f, 1e-30f, 89.0f, 120.0f}) x.push_back(v);
    for (size_t i = 0; i < x.size(); ++i) factor.push_back(0.5f + float(i % 7));
  }
};

// silu(g) * u at every level against double precision.
TEST(SimdLevels, SiluMulEveryLevel) {
  const GateInputs in;
  const std::vector<float>&g0 = in.x, &u = in.factor;
  for (CpuLevel level : runnable_levels()) {
    SCOPED_TRACE(cpu_level_name(level));
    std::vector<float> g = g0;
    simd::kernels(level).silu_mul(g.data(), u.data(), int64_t(g.size()));
    for (size_t i = 0; i < g.size(); ++i) {
      const double x = g0[i], ref = x / (1.0 + std::exp(-x)) * u[i];
      // Below ~1e-30 fp32 exp has overflowed (exp(89) > FLT_MAX): 0 is right.
      ASSERT_NEAR(g[i], ref, 1e-6 * std::fabs(ref) + 1e-30) << "x = " << x;
    }
  }
}

// silu(x) and y * sigmoid(g) at every level against double precision; and
// a row's bits do not depend on where a call starts (a batched step's row
// against the same row alone).
TEST(SimdLevels, SiluAndSigmoidMulEveryLevel) {
  const GateInputs in;
  const std::vector<float>&x0 = in.x, &y0 = in.factor;
  for (CpuLevel level : runnable_levels()) {
    SCOPED_TRACE(cpu_level_name(level));
    std::vector<float> s = x0, y = y0;
    simd::kernels(level).silu(s.data(), int64_t(s.size()));
    simd::kernels(level).sigmoid_mul(y.data(), x0.data(), int64_t(y.size()));
    for (size_t i = 0; i < x0.size(); ++i) {
      const double x = x0[i], sig = 1.0 / (1.0 + std::exp(-x));
      ASSERT_NEAR(s[i], x * sig, 1e-6 * std::fabs(x * sig) + 1e-30) << "x = " << x;
      ASSERT_NEAR(y[i], y0[i] * sig, 1e-6 * std::fabs(y0[i] * sig) + 1e-30) << "x = " << x;
    }
    // Rows of 32 (a head) called one by one give the bits of one call over all.
    std::vector<float> rows(x0.begin(), x0.begin() + 32 * 5), whole = rows;
    simd::kernels(level).silu(whole.data(), int64_t(whole.size()));
    for (int r = 0; r < 5; ++r) simd::kernels(level).silu(rows.data() + 32 * r, 32);
    EXPECT_EQ(rows, whole);
  }
}

// conv4_token at every level against the sums written out here, each
// product and sum rounded to float in the documented order (bit for bit:
// the prompt path forms them so), and the state shifted by one with the
// input appended; channel counts around the avx512 kernel's 16-wide steps.
TEST(SimdLevels, Conv4TokenEveryLevel) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (int64_t n : {1, 5, 15, 16, 17, 40, 64, 100}) {
    const size_t channels = static_cast<size_t>(n);
    std::vector<float> taps(channels * 4), state0(channels * 3), u(channels);
    for (float& v : taps) v = dist(rng);
    for (float& v : state0) v = dist(rng) * 8.0f;
    for (float& v : u) v = dist(rng) * 0.01f;
    std::vector<float> want(channels), want_state(channels * 3);
    for (int64_t c = 0; c < n; ++c) {
      const float* t = taps.data() + c * 4;
      const float* s = state0.data() + c * 3;
      volatile float acc = t[3] * u[size_t(c)];  // volatile: each step rounded, never fused
      volatile float p = t[0] * s[0];
      acc = acc + p;
      p = t[1] * s[1];
      acc = acc + p;
      p = t[2] * s[2];
      acc = acc + p;
      want[size_t(c)] = acc;
      want_state[size_t(c * 3)] = s[1];
      want_state[size_t(c * 3 + 1)] = s[2];
      want_state[size_t(c * 3 + 2)] = u[size_t(c)];
    }
    for (CpuLevel level : runnable_levels()) {
      SCOPED_TRACE(std::string(cpu_level_name(level)) + ", " + std::to_string(n) + " channels");
      std::vector<float> state = state0, y(channels, -1.0f);
      simd::kernels(level).conv4_token(taps.data(), state.data(), u.data(), n, y.data());
      EXPECT_EQ(y, want);
      EXPECT_EQ(state, want_state);
    }
  }
}

}  // namespace simd_levels_test
