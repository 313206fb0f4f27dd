// FP8 KV with `--kv-fp8-scale rotated`: per-head scales over Hadamard-rotated
// K and V rows. Checked against the unrotated rows it stores and against the
// attention over its own decoded rows (the rotation of the query and of the
// output must cancel the stored rotation exactly). Whether it beats `head`
// is a property of the model's keys, measured on coder-mini in
// docs/kv-quality.md, not asserted here: per-head absmax scaling stores a
// single outlier channel exactly (it is the absmax), which the rotation
// gives up.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "kv/kv_cache.h"
#include "kv/kv_kernels.h"

namespace kv_fp8_rotated_test {

using namespace flashmoe;

namespace {

using Vec = std::vector<float>;

KvConfig fp8(Fp8ScaleMode m) {
  KvConfig c;
  c.dtype = KvDType::FP8;
  c.fp8_scale = m;
  c.fp8_scale_set = true;
  return c;
}

// Keys with an outlier channel (channel 3 of each head is 40x the others)
// and queries that read it, as RoPE'd keys of real models have.
Vec outlier_row(std::mt19937& rng, int64_t nkv, int64_t hd) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Vec v(size_t(nkv * hd));
  for (auto& x : v) x = d(rng);
  for (int64_t h = 0; h < nkv; ++h) v[size_t(h * hd + 3)] = 40.0f + d(rng);
  return v;
}

}  // namespace

TEST(KvFp8Rotated, HadamardIsOrthonormalAndItsOwnInverse) {
  Vec x = {1, 2, 3, 4, 5, 6, 7, 8}, y = x;
  kv_kernels::hadamard_ortho(y.data(), 8);
  // Row 0 of H is all ones: y0 = sum / sqrt(8); row 1 alternates signs.
  EXPECT_NEAR(y[0], 36.0 / std::sqrt(8.0), 1e-5);
  EXPECT_NEAR(y[1], -4.0 / std::sqrt(8.0), 1e-5);
  double n0 = 0, n1 = 0;
  for (size_t i = 0; i < 8; ++i) n0 += x[i] * x[i], n1 += y[i] * y[i];
  EXPECT_NEAR(n0, n1, 1e-3);
  kv_kernels::hadamard_ortho(y.data(), 8);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

TEST(KvFp8Rotated, DecodesWithinFp8RoundingAndAttendsOverItsDecodedRows) {
  const int64_t nkv = 2, hd = 64, nh = 4, row = nkv * hd;
  std::mt19937 rng(5);
  KvCache rot(nkv, hd, fp8(Fp8ScaleMode::Rotated));
  std::vector<Vec> ks, vs;
  for (int64_t p = 0; p < 64; ++p) {
    ks.push_back(outlier_row(rng, nkv, hd));
    std::normal_distribution<float> d(0.0f, 1.0f);
    Vec v(static_cast<size_t>(row));
    for (auto& x : v) x = d(rng);
    vs.push_back(v);
    rot.append(p, ks.back().data(), v.data());
  }
  // Decoded rows are back in the model's basis, within fp8 rounding of the
  // head: |error|_2 <= 2^-4 |row|_2 per head (each rotated element is
  // rounded to within 2^-4 of itself and H keeps norms).
  Vec k(static_cast<size_t>(row)), v(static_cast<size_t>(row));
  std::vector<Vec> dk, dv;
  for (int64_t s = 0; s < 64; ++s) {
    rot.dequantize(s, k.data(), v.data());
    dk.push_back(k);
    dv.push_back(v);
    for (int64_t h = 0; h < nkv; ++h) {
      double e = 0, n = 0;
      for (int64_t i = h * hd; i < (h + 1) * hd; ++i) {
        e += (k[size_t(i)] - ks[size_t(s)][size_t(i)]) * (k[size_t(i)] - ks[size_t(s)][size_t(i)]);
        n += ks[size_t(s)][size_t(i)] * ks[size_t(s)][size_t(i)];
      }
      ASSERT_LE(std::sqrt(e), 0.0625 * std::sqrt(n)) << "slot " << s << " head " << h;
    }
  }
  // The attention of the rotated cache is the attention over its decoded
  // rows: the rotations of the query and of the output cancel the stored one.
  for (int trial = 0; trial < 8; ++trial) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    Vec q(size_t(nh * hd));
    for (auto& x : q) x = d(rng);
    for (int64_t h = 0; h < nh; ++h) q[size_t(h * hd + 3)] = 0.2f;  // reads the outlier channel
    const float scale = 0.125f;
    auto naive = [&](const std::vector<Vec>& K, const std::vector<Vec>& V) {
      Vec out(size_t(nh * hd), 0.0f);
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kvh = h / (nh / nkv);
        std::vector<double> sc;
        double mx = -1e300, sum = 0;
        for (size_t s = 0; s < K.size(); ++s) {
          double t = 0;
          for (int64_t i = 0; i < hd; ++i) t += double(q[size_t(h * hd + i)]) * K[s][size_t(kvh * hd + i)];
          sc.push_back(t * scale);
          mx = std::max(mx, sc.back());
        }
        for (auto& x : sc) sum += (x = std::exp(x - mx));
        for (size_t s = 0; s < K.size(); ++s)
          for (int64_t i = 0; i < hd; ++i) out[size_t(h * hd + i)] += float(sc[s] / sum * V[s][size_t(kvh * hd + i)]);
      }
      return out;
    };
    Vec o_rot(size_t(nh * hd));
    rot.attend(q.data(), nh, scale, o_rot.data());
    const Vec own = naive(dk, dv);
    for (size_t i = 0; i < own.size(); ++i) {
      ASSERT_NEAR(o_rot[i], own[i], 1e-4) << "trial " << trial << " i " << i;
    }
  }
}

TEST(KvFp8Rotated, ConfigurationAndErrors) {
  EXPECT_EQ(parse_fp8_scale_mode("rotated"), Fp8ScaleMode::Rotated);
  EXPECT_STREQ(fp8_scale_mode_name(Fp8ScaleMode::Rotated), "rotated");
  EXPECT_EQ(fp8(Fp8ScaleMode::Rotated).describe(), "dtype=fp8 fp8-scale=rotated full");
  try {
    KvCache c(2, 48, fp8(Fp8ScaleMode::Rotated));
    ADD_FAILURE() << "head_dim 48 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("power-of-two head_dim (this model's is 48)"), std::string::npos) << e.what();
  }
  try {
    parse_fp8_scale_mode("token");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("position, head, rotated, channel"), std::string::npos) << e.what();
  }
}

}  // namespace kv_fp8_rotated_test
