#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"
#include "kv/kv_cache.h"
#include "kv/kv_kernels.h"

namespace kv_cache_test {

using namespace flashmoe;

namespace {

using Vec = std::vector<float>;

Vec randn(std::mt19937& rng, size_t n, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Naive double-precision attention of one query over the given K/V rows.
Vec naive_attention(const Vec& q, int64_t nh, int64_t nkv, int64_t hd, float scale, const std::vector<Vec>& ks,
                    const std::vector<Vec>& vs) {
  Vec out(size_t(nh * hd), 0.0f);
  const int64_t G = nh / nkv, n = int64_t(ks.size());
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t kvh = h / G;
    std::vector<double> s(static_cast<size_t>(n));
    double mx = -1e300;
    for (int64_t j = 0; j < n; ++j) {
      double d = 0;
      for (int64_t i = 0; i < hd; ++i) d += double(q[size_t(h * hd + i)]) * ks[size_t(j)][size_t(kvh * hd + i)];
      s[size_t(j)] = d * scale;
      mx = std::max(mx, s[size_t(j)]);
    }
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - mx));
    for (int64_t i = 0; i < hd; ++i) {
      double o = 0;
      for (int64_t j = 0; j < n; ++j) o += s[size_t(j)] / sum * vs[size_t(j)][size_t(kvh * hd + i)];
      out[size_t(h * hd + i)] = float(o);
    }
  }
  return out;
}

// Reference over what the cache holds, dequantised.
Vec naive_over_cache(const KvCache& c, const Vec& q, int64_t nh, float scale) {
  std::vector<Vec> ks, vs;
  const size_t row = size_t(c.num_kv_heads() * c.head_dim());
  for (int64_t s = 0; s < c.size(); ++s) {
    Vec k(row), v(row);
    c.dequantize(s, k.data(), v.data());
    ks.push_back(k);
    vs.push_back(v);
  }
  return naive_attention(q, nh, c.num_kv_heads(), c.head_dim(), scale, ks, vs);
}

float max_abs_diff(const Vec& a, const Vec& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}
float max_abs(const Vec& a) {
  float m = 0;
  for (float x : a) m = std::max(m, std::fabs(x));
  return m;
}

KvConfig make_cfg(KvDType t, Fp8ScaleMode m = Fp8ScaleMode::Position) {
  KvConfig c;
  c.dtype = t;
  c.fp8_scale = m;
  return c;
}

struct Shape {
  int64_t nh, nkv, hd;
};

}  // namespace

// Every storage format: attend() equals naive double attention over the
// dequantised cache (exactly up to fp32 rounding), and stays close to the
// exact attention over the unquantised inputs.
TEST(KvCache, StorageFormatsMatchReference) {
  const Shape shapes[] = {{8, 2, 64}, {6, 2, 40}, {16, 2, 256}, {3, 1, 13}};
  const struct { KvDType t; Fp8ScaleMode m; float tol_vs_exact; } fmts[] = {
      {KvDType::F32, Fp8ScaleMode::Position, 1e-5f}, {KvDType::BF16, Fp8ScaleMode::Position, 2e-2f},
      {KvDType::F16, Fp8ScaleMode::Position, 3e-3f}, {KvDType::FP8, Fp8ScaleMode::Position, 0.12f},
      {KvDType::FP8, Fp8ScaleMode::Head, 0.12f}};
  for (const Shape& sh : shapes) {
    for (const auto& f : fmts) {
      std::mt19937 rng(42);
      const int64_t row = sh.nkv * sh.hd, T = 37;
      const float scale = 1.0f / std::sqrt(float(sh.hd));
      KvCache c(sh.nkv, sh.hd, make_cfg(f.t, f.m));
      std::vector<Vec> ks, vs;
      for (int64_t p = 0; p < T; ++p) {
        ks.push_back(randn(rng, size_t(row)));
        vs.push_back(randn(rng, size_t(row)));
        c.append(p, ks.back().data(), vs.back().data());
        const Vec q = randn(rng, size_t(sh.nh * sh.hd), 1.5f);
        Vec out(q.size());
        c.attend(q.data(), sh.nh, scale, out.data());
        const Vec ref_deq = naive_over_cache(c, q, sh.nh, scale);
        const Vec ref_exact = naive_attention(q, sh.nh, sh.nkv, sh.hd, scale, ks, vs);
        const float mag = std::max(1.0f, max_abs(ref_exact));
        ASSERT_LE(max_abs_diff(out, ref_deq), 1e-5f * mag)
            << kv_dtype_name(f.t) << " nh=" << sh.nh << " hd=" << sh.hd << " t=" << p;
        ASSERT_LE(max_abs_diff(out, ref_exact), f.tol_vs_exact * mag)
            << kv_dtype_name(f.t) << " nh=" << sh.nh << " hd=" << sh.hd << " t=" << p;
      }
      EXPECT_EQ(c.size(), T);
    }
  }
}

// A prompt chunk's tokens attend over their causal prefixes after the whole
// chunk is appended (the CPU prefill, on several threads): each must equal,
// bit for bit, attend() called right after that token's own append.
TEST(KvCache, PrefixAttentionEqualsTokenByToken) {
  const struct { KvDType t; Fp8ScaleMode m; } fmts[] = {
      {KvDType::F32, Fp8ScaleMode::Position}, {KvDType::BF16, Fp8ScaleMode::Position},
      {KvDType::FP8, Fp8ScaleMode::Rotated}};
  for (const auto& f : fmts) {
    std::mt19937 rng(3);
    const int64_t nh = 8, nkv = 2, hd = 32, T = 41;
    const float scale = 1.0f / std::sqrt(float(hd));
    KvCache step(nkv, hd, make_cfg(f.t, f.m)), chunk(nkv, hd, make_cfg(f.t, f.m));
    ASSERT_TRUE(chunk.supports_prefix_attention());
    std::vector<Vec> qs, outs;
    for (int64_t p = 0; p < T; ++p) {
      const Vec k = randn(rng, size_t(nkv * hd)), v = randn(rng, size_t(nkv * hd));
      qs.push_back(randn(rng, size_t(nh * hd), 1.5f));
      step.append(p, k.data(), v.data());
      chunk.append(p, k.data(), v.data());
      outs.emplace_back(size_t(nh * hd));
      step.attend(qs.back().data(), nh, scale, outs.back().data());
    }
    KvCache::AttendScratch scratch;
    for (int64_t p = T - 1; p >= 0; --p) {  // longest first, as the prefill does
      Vec out(size_t(nh * hd));
      chunk.attend_prefix(qs[size_t(p)].data(), nh, scale, out.data(), p + 1, scratch);
      ASSERT_EQ(out, outs[size_t(p)]) << kv_dtype_name(f.t) << " position " << p;
    }
  }
  KvConfig win;
  win.window = 8;
  KvCache w(2, 16, win), full(2, 16, KvConfig{});
  EXPECT_FALSE(w.supports_prefix_attention());
  Vec q(64), out(64), kv(32);
  KvCache::AttendScratch scratch;
  w.append(0, kv.data(), kv.data());
  EXPECT_THROW(w.attend_prefix(q.data(), 4, 1.0f, out.data(), 1, scratch), Error);
  full.append(0, kv.data(), kv.data());
  EXPECT_THROW(full.attend_prefix(q.data(), 4, 1.0f, out.data(), 2, scratch), Error);
}

// The values' weighted sum for a KV head's query group at once (each value
// row loaded once for all the heads) is, per head, the same bits as that
// head alone, for group sizes around the 4-head register block and head
// sizes that take the AVX-512 path (multiples of 16) and that do not.
TEST(KvCache, GroupedValueSumEqualsPerHeadBits) {
  std::mt19937 rng(9);
  for (int64_t n : {16, 24, 64, 80, 128})
    for (int64_t heads : {1, 2, 3, 4, 5, 8})
      for (int64_t nrows : {1, 16, 37}) {
        const int64_t ld = n + 16, wstride = nrows + 3;
        const Vec rows = randn(rng, size_t(nrows * ld)), w = randn(rng, size_t(heads * wstride));
        const Vec start = randn(rng, size_t(heads * n));
        Vec together = start, alone = start;
        kv_kernels::weighted_rows_acc_heads(rows.data(), ld, w.data(), wstride, heads, nrows, together.data(), n);
        for (int64_t h = 0; h < heads; ++h)
          kv_kernels::weighted_rows_acc(rows.data(), ld, w.data() + h * wstride, nrows, alone.data() + h * n, n);
        ASSERT_EQ(together, alone) << "n " << n << " heads " << heads << " rows " << nrows;
      }
}

TEST(KvCache, F32StorageIsLossless) {
  std::mt19937 rng(7);
  KvCache c(2, 16, KvConfig{});
  const Vec k = randn(rng, 32), v = randn(rng, 32);
  c.append(0, k.data(), v.data());
  Vec k2(32), v2(32);
  c.dequantize(0, k2.data(), v2.data());
  EXPECT_EQ(k, k2);
  EXPECT_EQ(v, v2);
}

// Per-head scales never lose to one scale per position, and win clearly when
// the KV heads have very different magnitudes.
TEST(KvCache, Fp8HeadScalesBeatPositionScales) {
  std::mt19937 rng(3);
  const int64_t nkv = 2, hd = 64;
  Vec k = randn(rng, size_t(nkv * hd)), v = randn(rng, size_t(nkv * hd));
  // Head 0 is 1e-5 of head 1: below the E4M3 subnormal range of a shared scale.
  for (int64_t i = 0; i < hd; ++i) k[size_t(i)] *= 1e-5f, v[size_t(i)] *= 1e-5f;
  double err[2] = {0, 0};
  Vec head1[2];
  const Fp8ScaleMode modes[2] = {Fp8ScaleMode::Position, Fp8ScaleMode::Head};
  for (int m = 0; m < 2; ++m) {
    KvCache c(nkv, hd, make_cfg(KvDType::FP8, modes[m]));
    c.append(0, k.data(), v.data());
    Vec k2(k.size()), v2(v.size());
    c.dequantize(0, k2.data(), v2.data());
    head1[m].assign(k2.begin() + hd, k2.end());
    for (int64_t i = 0; i < hd; ++i) err[m] += std::fabs(k2[size_t(i)] - k[size_t(i)]) + std::fabs(v2[size_t(i)] - v[size_t(i)]);
  }
  EXPECT_LT(err[1] * 10, err[0]);
  EXPECT_EQ(head1[0], head1[1]);  // the head holding the absmax has the same scale either way
}

TEST(KvCache, SlidingWindowAttendsOverTheLastW) {
  std::mt19937 rng(11);
  const int64_t nh = 4, nkv = 2, hd = 32, row = nkv * hd, W = 16;
  const float scale = 0.2f;
  for (KvDType t : {KvDType::F32, KvDType::FP8}) {
    KvConfig cfg = make_cfg(t);
    cfg.window = W;
    KvCache c(nkv, hd, cfg);
    EXPECT_EQ(c.capacity(), W);
    const size_t bytes0 = c.bytes();
    std::vector<Vec> ks, vs;
    for (int64_t p = 0; p < 100; ++p) {
      ks.push_back(randn(rng, size_t(row)));
      vs.push_back(randn(rng, size_t(row)));
      c.append(p, ks.back().data(), vs.back().data());
      EXPECT_EQ(c.size(), std::min<int64_t>(p + 1, W));
      EXPECT_EQ(c.slot_position(p % W), p);  // slot = pos mod W
      const Vec q = randn(rng, size_t(nh * hd));
      Vec out(q.size());
      c.attend(q.data(), nh, scale, out.data());
      const int64_t lo = std::max<int64_t>(0, p - W + 1);
      const std::vector<Vec> kw(ks.begin() + lo, ks.end()), vw(vs.begin() + lo, vs.end());
      const Vec ref = naive_attention(q, nh, nkv, hd, scale, kw, vw);
      if (t == KvDType::F32) ASSERT_LE(max_abs_diff(out, ref), 1e-5f) << "t=" << p;
      else ASSERT_LE(max_abs_diff(out, naive_over_cache(c, q, nh, scale)), 1e-5f) << "t=" << p;
    }
    std::vector<int64_t> want;
    for (int64_t p = 100 - W; p < 100; ++p) want.push_back(p);
    EXPECT_EQ(c.positions(), want);
    EXPECT_EQ(c.bytes(), bytes0);
  }
}

TEST(KvCache, StreamingKeepsSinksAndTheRecentWindow) {
  std::mt19937 rng(5);
  const int64_t nh = 2, nkv = 1, hd = 16, W = 12, S = 4;
  KvConfig cfg;
  cfg.window = W;
  cfg.streaming = true;
  cfg.sinks = S;
  KvCache c(nkv, hd, cfg);
  std::vector<Vec> ks, vs;
  for (int64_t p = 0; p < 50; ++p) {
    ks.push_back(randn(rng, size_t(hd)));
    vs.push_back(randn(rng, size_t(hd)));
    c.append(p, ks.back().data(), vs.back().data());
    const Vec q = randn(rng, size_t(nh * hd));
    Vec out(q.size());
    c.attend(q.data(), nh, 0.25f, out.data());
    std::vector<Vec> kr, vr;
    for (int64_t j = 0; j <= p; ++j)
      if (j < S || j > p - (W - S)) kr.push_back(ks[size_t(j)]), vr.push_back(vs[size_t(j)]);
    ASSERT_LE(max_abs_diff(out, naive_attention(q, nh, nkv, hd, 0.25f, kr, vr)), 1e-5f) << "t=" << p;
  }
  EXPECT_EQ(c.positions(), (std::vector<int64_t>{0, 1, 2, 3, 42, 43, 44, 45, 46, 47, 48, 49}));
}

// Crafted so the heavy hitters are known: every query points along e0, the
// "heavy" tokens have a large key along e0 (20 + pos: the newest heavy token
// takes nearly all the attention) and every other key is zero, so the other
// tokens collect almost no score once a heavy token exists.
TEST(KvCache, H2OKeepsSinksRecentsAndHeavyHittersInOrder) {
  const int64_t nh = 2, nkv = 1, hd = 8, B = 10;
  KvConfig cfg;
  cfg.h2o_budget = B;
  cfg.sinks = 2;
  cfg.recent_fraction = 0.3;  // R = 3, so 5 heavy-hitter slots
  cfg.window = 4;             // h2o wins over a window
  ASSERT_EQ(cfg.h2o_recent(), 3);
  ASSERT_EQ(cfg.retention(), KvRetention::H2O);
  KvCache c(nkv, hd, cfg);
  EXPECT_EQ(c.capacity(), B);
  const std::set<int64_t> heavy = {6, 11, 17, 23, 30};
  std::mt19937 rng(9);
  std::map<int64_t, std::pair<Vec, Vec>> kv;
  const Vec q = [] { Vec v(size_t(2 * 8), 0.0f); v[0] = 1.0f; v[8] = 1.0f; return v; }();
  const size_t bytes0 = c.bytes();
  for (int64_t p = 0; p < 40; ++p) {
    Vec k(size_t(hd), 0.0f), v = randn(rng, size_t(hd));
    if (heavy.count(p)) k[0] = 20.0f + float(p);
    kv[p] = {k, v};
    c.append(p, k.data(), v.data());
    ASSERT_LE(c.size(), B);
    for (int64_t s = 1; s < c.size(); ++s) ASSERT_LT(c.slot_position(s - 1), c.slot_position(s));  // chronological
    Vec out(q.size());
    c.attend(q.data(), nh, 1.0f, out.data());
    std::vector<Vec> kr, vr;
    for (int64_t pos : c.positions()) kr.push_back(kv[pos].first), vr.push_back(kv[pos].second);
    ASSERT_LE(max_abs_diff(out, naive_attention(q, nh, nkv, hd, 1.0f, kr, vr)), 1e-5f);
  }
  EXPECT_EQ(c.positions(), (std::vector<int64_t>{0, 1, 6, 11, 17, 23, 30, 37, 38, 39}));
  for (int64_t s = 0; s < c.size(); ++s) EXPECT_EQ(c.slot_position(s), c.positions()[size_t(s)]);
  EXPECT_EQ(c.bytes(), bytes0);
  EXPECT_GT(c.score(3), 10.0f);  // slot 3 holds position 11, a heavy hitter
}

// The documented semantics, simulated naively (double scores, recomputed
// attention) on random data: same retained set after every token.
TEST(KvCache, H2OMatchesNaiveSimulation) {
  const int64_t nh = 4, nkv = 2, hd = 16, B = 12, T = 200;
  KvConfig cfg;
  cfg.h2o_budget = B;
  cfg.sinks = 3;
  cfg.recent_fraction = 0.25;
  const int64_t R = cfg.h2o_recent();
  ASSERT_EQ(R, 3);
  KvCache c(nkv, hd, cfg);
  std::mt19937 rng(21);
  std::vector<int64_t> kept;  // chronological
  std::map<int64_t, double> score;
  std::map<int64_t, std::pair<Vec, Vec>> kv;
  for (int64_t p = 0; p < T; ++p) {
    const Vec k = randn(rng, size_t(nkv * hd), 2.0f), v = randn(rng, size_t(nkv * hd));
    kv[p] = {k, v};
    kept.push_back(p);
    score[p] = 0;
    if (int64_t(kept.size()) > B) {
      size_t victim = size_t(cfg.sinks);
      for (size_t i = victim + 1; i < kept.size() - size_t(R); ++i)
        if (score[kept[i]] < score[kept[victim]]) victim = i;
      kept.erase(kept.begin() + int64_t(victim));
    }
    c.append(p, k.data(), v.data());
    ASSERT_EQ(c.positions(), kept) << "t=" << p;
    const Vec q = randn(rng, size_t(nh * hd));
    Vec out(q.size());
    c.attend(q.data(), nh, 0.25f, out.data());
    // Naive probabilities, accumulated over the query heads.
    for (int64_t h = 0; h < nh; ++h) {
      std::vector<double> s;
      double mx = -1e300, sum = 0;
      for (int64_t pos : kept) {
        double d = 0;
        for (int64_t i = 0; i < hd; ++i) d += double(q[size_t(h * hd + i)]) * kv[pos].first[size_t((h / 2) * hd + i)];
        s.push_back(d * 0.25);
        mx = std::max(mx, s.back());
      }
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (size_t i = 0; i < kept.size(); ++i) score[kept[i]] += s[i] / sum;
    }
    for (int64_t sl = 0; sl < c.size(); ++sl)
      ASSERT_NEAR(c.score(sl), score[kept[size_t(sl)]], 1e-3) << "t=" << p;
  }
}

TEST(KvCache, MemoryIsAllocatedOnceForWindowAndH2O) {  // and streaming, tova
  const int64_t nkv = 2, hd = 32, row = nkv * hd;
  std::mt19937 rng(1);
  const Vec k = randn(rng, size_t(row)), v = randn(rng, size_t(row)), q = randn(rng, size_t(4 * hd));
  Vec out(q.size());
  for (KvDType t : {KvDType::F32, KvDType::BF16, KvDType::F16, KvDType::FP8}) {
    for (int policy = 0; policy < 4; ++policy) {
      KvConfig cfg = make_cfg(t, Fp8ScaleMode::Head);
      int64_t cap = 0;
      if (policy == 0) cfg.window = cap = 64;
      if (policy == 1) cfg.streaming = true, cfg.window = cap = 48;
      if (policy == 2) cfg.h2o_budget = cap = 32;
      if (policy == 3) cfg.tova_budget = cap = 40;
      KvCache c(nkv, hd, cfg);
      // The allocation has the element size of this dtype from the start.
      const size_t scales = t == KvDType::FP8 ? size_t(2 * cap * nkv * 4) : 0;
      const size_t book = size_t(cap * 8) + (policy >= 2 ? size_t(cap * 4) : 0);
      EXPECT_EQ(c.bytes(), size_t(2 * cap * row) * kv_elem_size(t) + scales + book) << kv_dtype_name(t) << policy;
      const size_t b0 = c.bytes();
      const int64_t steps = policy == 3 ? 4000 : 20000;  // tova: the h2o path with one line changed
      for (int64_t p = 0; p < steps; ++p) {
        c.append(p, k.data(), v.data());
        if (policy >= 2 || p % 1000 == 0) c.attend(q.data(), 4, 0.1f, out.data());
        ASSERT_EQ(c.bytes(), b0) << kv_dtype_name(t) << " policy " << policy << " p=" << p;
      }
      EXPECT_EQ(c.size(), cap);
    }
  }
}

TEST(KvCache, FullCacheGrowsAndClears) {
  KvCache c(1, 8, KvConfig{});
  const Vec k(8, 1.0f), v(8, 2.0f);
  for (int64_t p = 0; p < 100; ++p) c.append(p, k.data(), v.data());
  EXPECT_EQ(c.size(), 100);
  EXPECT_GE(c.bytes(), size_t(100 * 2 * 8 * 4));
  c.clear();
  EXPECT_EQ(c.size(), 0);
  c.append(0, k.data(), v.data());
  EXPECT_EQ(c.size(), 1);
}

TEST(KvCache, CopiesAreIndependentSnapshots) {
  std::mt19937 rng(2);
  KvConfig cfg = make_cfg(KvDType::FP8);
  cfg.h2o_budget = 8;
  cfg.sinks = 1;
  KvCache a(2, 16, cfg);
  for (int64_t p = 0; p < 20; ++p) {
    const Vec k = randn(rng, 32), v = randn(rng, 32), q = randn(rng, 64);
    Vec out(64);
    a.append(p, k.data(), v.data());
    a.attend(q.data(), 4, 0.25f, out.data());
  }
  KvCache b = a;
  for (int64_t p = 20; p < 40; ++p) {
    const Vec k = randn(rng, 32), v = randn(rng, 32), q = randn(rng, 64);
    Vec oa(64), ob(64);
    a.append(p, k.data(), v.data());
    b.append(p, k.data(), v.data());
    a.attend(q.data(), 4, 0.25f, oa.data());
    b.attend(q.data(), 4, 0.25f, ob.data());
    ASSERT_EQ(oa, ob);
  }
  EXPECT_EQ(a.positions(), b.positions());
}

TEST(KvCache, RejectsOutOfOrderPositionsAndBadHeads) {
  KvCache c(2, 4, KvConfig{});
  const Vec k(8, 0.0f);
  c.append(5, k.data(), k.data());
  EXPECT_THROW(c.append(5, k.data(), k.data()), Error);
  Vec out(12);
  const Vec q(12, 0.0f);
  EXPECT_THROW(c.attend(q.data(), 3, 1.0f, out.data()), Error);
}

namespace {
std::string error_of(const KvConfig& c) {
  try {
    c.validate();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(KvConfig, BadConfigurationsGiveClearErrors) {
  KvConfig c;
  c.h2o_budget = 4;  // sinks 4
  EXPECT_NE(error_of(c).find("at least sinks + 1 = 5"), std::string::npos) << error_of(c);
  EXPECT_THROW(KvCache(2, 8, c), Error);
  c = KvConfig{};
  c.window = 3;
  c.streaming = true;
  EXPECT_NE(error_of(c).find("--kv-streaming window 3 is too small"), std::string::npos) << error_of(c);
  c.window = 5;
  EXPECT_EQ(error_of(c), "");
  c = KvConfig{};
  c.fp8_scale = Fp8ScaleMode::Head;
  c.fp8_scale_set = true;
  EXPECT_NE(error_of(c).find("--kv-fp8-scale needs --kv-dtype fp8"), std::string::npos) << error_of(c);
  c.dtype = KvDType::FP8;
  EXPECT_EQ(error_of(c), "");
  for (double f : {-0.1, 1.5, std::nan("")}) {
    c = KvConfig{};
    c.h2o_budget = 64;
    c.recent_fraction = f;
    EXPECT_NE(error_of(c).find("--kv-recent must be a fraction"), std::string::npos) << error_of(c);
  }
  c = KvConfig{};
  c.recent_set = true;
  c.window = 16;
  EXPECT_NE(error_of(c).find("--kv-recent only applies to --kv-h2o"), std::string::npos) << error_of(c);
  c = KvConfig{};
  c.sinks_set = true;
  c.window = 16;
  EXPECT_NE(error_of(c).find("--kv-sinks only applies"), std::string::npos) << error_of(c);
  c = KvConfig{};
  c.window = -2;
  EXPECT_NE(error_of(c).find("--kv-window must be positive"), std::string::npos);
  c = KvConfig{};
  c.window = 16;
  c.window_set = true;
  c.streaming = true;
  EXPECT_NE(error_of(c).find("exclusive"), std::string::npos);

  try {
    parse_kv_dtype("fp4");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f32, bf16, f16, fp8"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_kv_dtype("BF16"), KvDType::BF16);
  EXPECT_THROW(parse_fp8_scale_mode("tensor"), Error);
}

TEST(KvConfig, RecentCountAndCapacity) {
  KvConfig c;
  c.h2o_budget = 4096;
  EXPECT_EQ(c.h2o_recent(), 1024);
  EXPECT_EQ(c.capacity(), 4096);
  EXPECT_EQ(c.retained(100), 100);
  EXPECT_EQ(c.retained(100000), 4096);
  c.recent_fraction = 1.0;  // clamped: no heavy hitters left, sinks + recents
  EXPECT_EQ(c.h2o_recent(), 4092);
  c.recent_fraction = 0.0;  // the newest token is always kept
  EXPECT_EQ(c.h2o_recent(), 1);
  KvConfig w;
  w.window = 256;
  EXPECT_EQ(w.retention(), KvRetention::Window);
  EXPECT_EQ(w.capacity(), 256);
  EXPECT_EQ(KvConfig{}.capacity(), 0);
}

}  // namespace kv_cache_test
