#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kv/kv_kernels.h"
#include "kv/fp8_e4m3.h"

namespace kv_fp8_test {

using namespace flashmoe;
using fp8::e4m3_decode;
using fp8::e4m3_encode;

namespace {

// The OCP E4M3 value of a code, straight from the bit fields (double math).
double ocp_value(int c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  double a = e == 0 ? m / 512.0 : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -a : a;
}

// Brute force: the code nearest to x among the finite codes of x's sign,
// ties to the even code; beyond the largest value saturate.
uint8_t nearest_code(float x) {
  const bool neg = std::signbit(x);
  const double ax = std::fabs(double(x));
  int best = -1;
  double best_d = 0;
  for (int m = 0; m < 0x7f; ++m) {  // 0x7f is NaN
    const double d = std::fabs(ocp_value(m) - ax);
    if (best < 0 || d < best_d || (d == best_d && (m & 1) == 0)) {
      best = m;
      best_d = d;
    }
  }
  return uint8_t((neg ? 0x80 : 0) | best);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

}  // namespace

TEST(Fp8E4M3, AllCodesDecodeToOcpValues) {
  for (int c = 0; c < 256; ++c) {
    const double want = ocp_value(c);
    const float got = e4m3_decode(uint8_t(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ(double(got), want) << "code " << c;
    EXPECT_EQ(std::signbit(got), bool(c & 0x80)) << "code " << c;
  }
  EXPECT_EQ(e4m3_decode(0x7e), 448.0f);
  EXPECT_EQ(e4m3_decode(0xfe), -448.0f);
  EXPECT_EQ(e4m3_decode(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_decode(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_decode(0x38), 1.0f);
}

TEST(Fp8E4M3, EncodeDecodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(e4m3_encode(e4m3_decode(uint8_t(c))), c) << "code " << c;
  }
}

TEST(Fp8E4M3, SignedZero) {
  EXPECT_EQ(e4m3_encode(0.0f), 0x00);
  EXPECT_EQ(e4m3_encode(-0.0f), 0x80);
  EXPECT_TRUE(std::signbit(e4m3_decode(0x80)));
  EXPECT_EQ(e4m3_encode(-std::ldexp(1.0f, -12)), 0x80);  // rounds to -0
}

TEST(Fp8E4M3, TiesRoundToEven) {
  for (int c = 0; c < 0x7e; ++c) {  // adjacent positive finite codes c, c+1
    const double lo = ocp_value(c), hi = ocp_value(c + 1);
    const float mid = float((lo + hi) / 2);  // exact in float
    ASSERT_EQ(double(mid), (lo + hi) / 2);
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(e4m3_encode(mid), even) << "midpoint of codes " << c << " and " << c + 1;
    EXPECT_EQ(e4m3_encode(-mid), 0x80 | even) << "negative midpoint of codes " << c << " and " << c + 1;
    // Just off the midpoint goes to the nearer side.
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, 1000.0f)), c + 1);
  }
}

TEST(Fp8E4M3, SaturatesAt448) {
  for (float x : {448.0f, 448.5f, 460.0f, 464.0f, 479.9f, 480.0f, 512.0f, 1e6f, 3e38f,
                  std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(e4m3_encode(x), 0x7e) << x;
    EXPECT_EQ(e4m3_encode(-x), 0xfe) << -x;
  }
  EXPECT_EQ(e4m3_encode(416.0f), 0x7d);
  EXPECT_EQ(e4m3_encode(431.0f), 0x7d);
  EXPECT_EQ(e4m3_encode(432.0f), 0x7e);  // tie between 416 (odd 0x7d) and 448 (even 0x7e)
}

TEST(Fp8E4M3, NaNPreserved) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(e4m3_encode(qnan), 0x7f);
  EXPECT_EQ(e4m3_encode(-qnan), 0xff);
  EXPECT_EQ(e4m3_encode(std::numeric_limits<float>::signaling_NaN()), 0x7f);
  EXPECT_TRUE(std::isnan(e4m3_decode(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_decode(0xff)));
}

TEST(Fp8E4M3, RandomValuesEncodeToNearest) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_real_distribution<double> expo(-14.0, 9.5);
  int n = 0;
  auto check = [&](float x) {
    ASSERT_EQ(e4m3_encode(x), nearest_code(x)) << "x = " << x;
    ++n;
  };
  for (int i = 0; i < 20000; ++i) check(uni(rng) * 500.0f);           // the whole range and beyond
  for (int i = 0; i < 20000; ++i) check(float((uni(rng) < 0 ? -1 : 1) * std::pow(2.0, expo(rng))));  // log-uniform
  // As the KV cache encodes: x / scale with scale = absmax / 240, for values
  // far below absmax (1e-6 x absmax) and in the 2^-9..2^-6 x scale band the
  // seed's encoder corrupted.
  for (int i = 0; i < 20000; ++i) {
    const float absmax = std::pow(10.0f, uni(rng) * 4.0f);
    const float scale = absmax / 240.0f;
    const float tiny = absmax * 1e-6f * uni(rng) * 3.0f;
    check(tiny / scale);
    const float band = float(std::pow(2.0, -9.0 + 3.0 * (uni(rng) + 1.0) / 2.0)) * (uni(rng) < 0 ? -1.0f : 1.0f);
    check((band * scale) / scale);
    check(band);
  }
  // Every subnormal and near-subnormal step, densely.
  for (int i = 0; i <= 4096; ++i) check(std::ldexp(float(i), -15));
  EXPECT_GT(n, 100000);
}

TEST(Fp8E4M3, SimdDecodeMatchesTable) {
  std::vector<uint8_t> codes(256 + 5);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t(i * 7 + 3);
  for (int c = 0; c < 256; ++c) codes[size_t(c)] = uint8_t(c);
  for (float scale : {1.0f, 0.0123f, 3.7f}) {
    std::vector<float> out(codes.size());
    kv_kernels::fp8_e4m3_to_f32(codes.data(), int64_t(codes.size()), scale, out.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      const float want = e4m3_decode(codes[i]) * scale;
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(out[i])) << "code " << int(codes[i]);
      else EXPECT_TRUE(same_bits(out[i], want)) << "code " << int(codes[i]) << " scale " << scale;
    }
  }
}

TEST(Fp8E4M3, BlockScale) {
  const float z[4] = {0, 0, -0.0f, 0};
  EXPECT_EQ(fp8::e4m3_block_scale(z, 4), 1.0f);
  const float x[3] = {1.0f, -480.0f, 3.0f};
  EXPECT_EQ(fp8::e4m3_block_scale(x, 3), 2.0f);
  uint8_t out[3];
  fp8::e4m3_encode_scaled(x, 3, 2.0f, out);
  EXPECT_EQ(out[1], 0xf7);  // -240 = -1.875 * 2^7: sign, exponent 14, mantissa 7
  EXPECT_EQ(e4m3_decode(out[1]) * 2.0f, -480.0f);
}

}  // namespace kv_fp8_test
