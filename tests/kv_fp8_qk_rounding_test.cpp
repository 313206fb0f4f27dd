// fp8 `channel` keys rounded against the queries' second moment
// (kv/qk_rounding.h): the Cholesky factor against H computed directly, the
// error e^T H e against rounding to nearest on random H and keys, a
// projector H whose subspace takes (almost) none of the error, and the
// cache: attention over its own decoded rows, q.k errors of queries like
// the observed ones below those of nearest rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kv/fp8_e4m3.h"
#include "kv/kv_cache.h"
#include "kv/kv_kernels.h"
#include "kv/qk_rounding.h"
#include "test_util.h"

namespace kv_fp8_qk_rounding_test {

using namespace flashmoe;
using flashmoe::test::naive_softmax_weights;

namespace {

using Vec = std::vector<float>;

Vec gauss(std::mt19937& rng, int64_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  Vec v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// The full symmetric d x d matrix of a packed lower triangle.
Vec unpack(const Vec& Hp, int64_t d) {
  Vec H(static_cast<size_t>(d * d));
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j <= i; ++j) H[size_t(i * d + j)] = H[size_t(j * d + i)] = Hp[size_t(i * (i + 1) / 2 + j)];
  return H;
}

// e^T H e with H as given (no factor involved).
double quad(const Vec& H, const std::vector<double>& e) {
  const int64_t d = int64_t(e.size());
  double s = 0;
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j) s += e[size_t(i)] * double(H[size_t(i * d + j)]) * e[size_t(j)];
  return s;
}

std::vector<double> err(const Vec& x, const std::vector<uint8_t>& code, float scale) {
  std::vector<double> e(x.size());
  for (size_t i = 0; i < x.size(); ++i) e[i] = double(x[i]) - double(fp8::e4m3_decode(code[i]) * scale);
  return e;
}

// Queries concentrated in a few directions, as a head's queries are:
// q = A g, A d x d with column j scaled by 0.7^j.
Vec skewed_query(std::mt19937& rng, const Vec& A, int64_t d) {
  const Vec g = gauss(rng, d);
  Vec q(static_cast<size_t>(d), 0.0f);
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j) q[size_t(i)] += A[size_t(i * d + j)] * std::pow(0.7f, float(j)) * g[size_t(j)];
  return q;
}

}  // namespace

// L L^T = H + damp (trace(H) / d) I, and qk_error is e^T (that) e.
TEST(QkRounding, CholeskyAndErrorAgainstHDirectly) {
  const int64_t d = 16;
  std::mt19937 rng(1);
  Vec Hp(static_cast<size_t>(fp8::packed_triangle(d)), 0.0f);
  for (int t = 0; t < 5; ++t) fp8::add_outer_product(Hp.data(), gauss(rng, d).data(), d);  // rank 5
  const Vec H = unpack(Hp, d);
  std::vector<float> L;
  ASSERT_TRUE(fp8::damped_cholesky(Hp.data(), d, 0.01, L));
  double tr = 0;
  for (int64_t i = 0; i < d; ++i) tr += H[size_t(i * d + i)];
  Vec Hd = H;
  for (int64_t i = 0; i < d; ++i) Hd[size_t(i * d + i)] += float(0.01 * tr / d);
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j) {
      double s = 0;
      for (int64_t k = 0; k < d; ++k) s += L[size_t(i * d + k)] * L[size_t(j * d + k)];
      EXPECT_NEAR(s, Hd[size_t(i * d + j)], 1e-5 * tr) << i << "," << j;  // L is float
      if (j > i) {
        EXPECT_EQ(L[size_t(i * d + j)], 0.0f);
      }
    }
  const Vec x = gauss(rng, d);
  std::vector<uint8_t> code(static_cast<size_t>(d));
  fp8::e4m3_encode_scaled(x.data(), d, 0.01f, code.data());
  EXPECT_NEAR(fp8::qk_error(x.data(), code.data(), d, 0.01f, L.data()), quad(Hd, err(x, code, 0.01f)), 1e-5 * tr);
  Vec zero(static_cast<size_t>(fp8::packed_triangle(d)), 0.0f);
  EXPECT_FALSE(fp8::damped_cholesky(zero.data(), d, 0.01, L));
}

// Random anisotropic H and keys: every key's e^T H e is at most nearest
// rounding's (the better of the two is kept), and on average far below it.
TEST(QkRounding, NeverWorseThanNearestAndFarBetterOnAverage) {
  const int64_t d = 64;
  std::mt19937 rng(2);
  const Vec A = gauss(rng, d * d);
  Vec Hp(static_cast<size_t>(fp8::packed_triangle(d)), 0.0f);
  for (int t = 0; t < 400; ++t) fp8::add_outer_product(Hp.data(), skewed_query(rng, A, d).data(), d);
  const Vec H = unpack(Hp, d);
  std::vector<float> L;
  ASSERT_TRUE(fp8::damped_cholesky(Hp.data(), d, 0.01, L));
  double sum_qk = 0, sum_near = 0;
  std::vector<uint8_t> near(static_cast<size_t>(d)), qk(near);
  for (int t = 0; t < 200; ++t) {
    const Vec x = gauss(rng, d);
    const float s = fp8::e4m3_mse_scale(x.data(), d);
    fp8::e4m3_encode_scaled(x.data(), d, s, near.data());
    const double returned = fp8::e4m3_encode_qk(x.data(), d, s, L.data(), qk.data());
    const double eq = quad(H, err(x, qk, s)), en = quad(H, err(x, near, s));
    EXPECT_EQ(returned, fp8::qk_error(x.data(), qk.data(), d, s, L.data())) << t;
    EXPECT_LE(returned, fp8::qk_error(x.data(), near.data(), d, s, L.data())) << t;
    sum_qk += eq;
    sum_near += en;
  }
  EXPECT_LT(sum_qk, 0.5 * sum_near) << "qk " << sum_qk << " nearest " << sum_near;
}

// H = the projector onto a random 4-dimensional subspace (+ a little
// damping): the error is pushed out of it, |P e|^2 far below nearest's,
// while the whole error |e|^2 grows (it went somewhere).
TEST(QkRounding, ProjectorSubspaceTakesAlmostNoError) {
  const int64_t d = 64, r = 4;
  std::mt19937 rng(3);
  // Orthonormal basis of the subspace (Gram-Schmidt).
  std::vector<Vec> U;
  while (int64_t(U.size()) < r) {
    Vec u = gauss(rng, d);
    for (const Vec& w : U) {
      double dot = 0;
      for (int64_t i = 0; i < d; ++i) dot += double(u[size_t(i)]) * w[size_t(i)];
      for (int64_t i = 0; i < d; ++i) u[size_t(i)] -= float(dot) * w[size_t(i)];
    }
    double n = 0;
    for (float v : u) n += double(v) * v;
    for (float& v : u) v = float(v / std::sqrt(n));
    U.push_back(u);
  }
  Vec Pp(static_cast<size_t>(fp8::packed_triangle(d)), 0.0f);
  for (const Vec& u : U) fp8::add_outer_product(Pp.data(), u.data(), d);
  const Vec P = unpack(Pp, d);
  std::vector<float> L;
  ASSERT_TRUE(fp8::damped_cholesky(Pp.data(), d, 1e-3, L));
  double pq = 0, pn = 0, wq = 0, wn = 0;
  std::vector<uint8_t> near(static_cast<size_t>(d)), qk(near);
  for (int t = 0; t < 200; ++t) {
    const Vec x = gauss(rng, d);
    const float s = fp8::e4m3_mse_scale(x.data(), d);
    fp8::e4m3_encode_scaled(x.data(), d, s, near.data());
    fp8::e4m3_encode_qk(x.data(), d, s, L.data(), qk.data());
    const std::vector<double> eq = err(x, qk, s), en = err(x, near, s);
    pq += quad(P, eq);
    pn += quad(P, en);
    for (int64_t i = 0; i < d; ++i) {
      wq += eq[size_t(i)] * eq[size_t(i)];
      wn += en[size_t(i)] * en[size_t(i)];
    }
  }
  EXPECT_LT(pq, 0.1 * pn) << "projected: qk " << pq << " nearest " << pn;
  EXPECT_GT(wq, wn) << "whole error: qk " << wq << " nearest " << wn;
}

namespace {

KvConfig channel() {
  KvConfig c;
  c.dtype = KvDType::FP8;
  c.fp8_scale = Fp8ScaleMode::Channel;
  c.fp8_scale_set = true;
  return c;
}

// Keys as partially RoPE'd heads make them (a per-channel constant plus a
// variation), queries from a skewed distribution per head.
Vec channel_key(std::mt19937& rng, int64_t row) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Vec k(static_cast<size_t>(row));
  for (int64_t i = 0; i < row; ++i) k[size_t(i)] = 8.0f * std::sin(float(i) * 0.7f + 1.0f) + d(rng);
  return k;
}

Vec queries(std::mt19937& rng, const Vec& A, int64_t nh, int64_t hd) {
  Vec q;
  for (int64_t h = 0; h < nh; ++h) {
    const Vec qh = skewed_query(rng, A, hd);
    q.insert(q.end(), qh.begin(), qh.end());
  }
  return q;
}

}  // namespace

// The cache: with the queries added before the keys (as the model does),
// (1) attention is the softmax over its own decoded rows, prefix attention
// the same bits; (2) for fresh queries of the same distribution the q.k
// errors (against the exact keys) are well below those of the same cache
// without queries (channel's nearest roundings); the values are the same.
TEST(KvFp8QkRounding, CacheRoundsKeysAgainstTheQueriesSeen) {
  const int64_t nkv = 2, hd = 64, nh = 4, G = nh / nkv, row = nkv * hd, n = 300;
  std::mt19937 rng(5);
  const Vec A = gauss(rng, hd * hd);
  KvCache qk(nkv, hd, channel()), plain(nkv, hd, channel());
  std::vector<Vec> keys;
  for (int64_t p = 0; p < n; ++p) {
    const Vec k = channel_key(rng, row), v = gauss(rng, row), q = queries(rng, A, nh, hd);
    qk.add_query_moments(q.data(), 1, nh);
    qk.append(p, k.data(), v.data());
    plain.append(p, k.data(), v.data());
    keys.push_back(k);
  }
  std::vector<Vec> dk;
  Vec k(static_cast<size_t>(row)), v(static_cast<size_t>(row)), pk(k), pv(k);
  for (int64_t s = 0; s < n; ++s) {
    qk.dequantize(s, k.data(), v.data());
    plain.dequantize(s, pk.data(), pv.data());
    dk.push_back(k);
    // Values are rounded as channel's either way.
    for (int64_t i = 0; i < row; ++i) ASSERT_EQ(v[size_t(i)], pv[size_t(i)]) << s << " " << i;
  }
  double e_qk = 0, e_plain = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const Vec q = queries(rng, A, nh, hd);
    for (int64_t s = 0; s < n; ++s) {
      plain.dequantize(s, pk.data(), pv.data());
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kvh = h / G;
        double a = 0, b = 0;
        for (int64_t i = 0; i < hd; ++i) {
          const double qi = q[size_t(h * hd + i)], ki = keys[size_t(s)][size_t(kvh * hd + i)];
          a += qi * (ki - dk[size_t(s)][size_t(kvh * hd + i)]);
          b += qi * (ki - pk[size_t(kvh * hd + i)]);
        }
        e_qk += a * a;
        e_plain += b * b;
      }
    }
  }
  EXPECT_LT(e_qk, 0.5 * e_plain) << "q.k squared error: qk " << e_qk << " nearest " << e_plain;

  const float scale = 0.125f;
  const Vec q = queries(rng, A, nh, hd);
  Vec o(static_cast<size_t>(nh * hd)), o_pre(o), o_own(o.size(), 0.0f);
  qk.attend(q.data(), nh, scale, o.data());
  KvCache::AttendScratch sc;
  qk.attend_prefix(q.data(), nh, scale, o_pre.data(), n, sc);
  ASSERT_EQ(std::memcmp(o_pre.data(), o.data(), o.size() * 4), 0);
  for (int64_t h = 0; h < nh; ++h) {  // naive softmax over the decoded rows
    const int64_t kvh = h / G;
    const std::vector<double> p = naive_softmax_weights(q.data() + h * hd, dk, kvh, hd, n, scale);
    for (int64_t s = 0; s < n; ++s) {
      qk.dequantize(s, k.data(), v.data());
      for (int64_t i = 0; i < hd; ++i) o_own[size_t(h * hd + i)] += float(p[size_t(s)] * v[size_t(kvh * hd + i)]);
    }
  }
  for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], o_own[i], 1e-4) << i;
}

}  // namespace kv_fp8_qk_rounding_test
