// TOVA retention (--kv-tova B) on the CPU's KvCache: evictions derived by
// hand on crafted attention, and the documented semantics simulated naively.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "core/error.h"
#include "kv/kv_cache.h"

namespace kv_tova_test {

using namespace flashmoe;

namespace {

using Vec = std::vector<float>;

Vec randn(std::mt19937& rng, size_t n, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Two query heads over one KV head, head_dim 2, scale 1: head h's query is
// qs[h] (2 values), keys are (k0, k1), values are irrelevant (zero).
struct Step {
  float k0, k1;   // key of the token appended at this step
  Vec q;          // [2 heads x 2]
};

std::vector<int64_t> run(const KvConfig& cfg, const std::vector<Step>& steps, KvCache* out = nullptr) {
  KvCache c(1, 2, cfg);
  const Vec v(2, 0.0f);
  Vec o(4);
  for (size_t p = 0; p < steps.size(); ++p) {
    const Vec k = {steps[p].k0, steps[p].k1};
    c.append(int64_t(p), k.data(), v.data());
    c.attend(steps[p].q.data(), 2, 1.0f, o.data());
  }
  if (out) *out = c;
  return c.positions();
}

}  // namespace

// Budget 4, 1 sink. Keys: p1 = (6,0), p2 = (0,6), the others 0. Steps 0-2
// attend uniformly (zero queries). Step 3: head 0 looks along e0 (p1 gets
// ~1), head 1 along e1 (p2 gets ~1); p3 gets 2/(e^6+3) summed over the
// heads, the least of the candidates p1..p3 (p0 is a sink): token 4 evicts
// p3, the latest query's own token (a single head would tie p2 with p3 and
// evict p2). Step 4: both heads look along e1: p2 gets 2e^6/(e^6+3), p1 and
// p4 2/(e^6+3) each, a tie that the older p1 loses: token 5 evicts p1,
// though p1 took a whole head's attention one step before. H2O (recent 1)
// accumulates instead: p1 holds ~2.7 against p4's ~0, so it evicts p4.
TEST(KvTova, EvictsWhatTheLatestQueryAttendsToLeast) {
  const Vec zero(4, 0.0f), split = {1, 0, 0, 1}, along1 = {0, 1, 0, 1};
  const std::vector<Step> steps = {{0, 0, zero}, {6, 0, zero}, {0, 6, zero},
                                   {0, 0, split}, {0, 0, along1}, {0, 0, zero}};
  KvConfig tova;
  tova.tova_budget = 4;
  tova.sinks = 1;
  ASSERT_EQ(tova.retention(), KvRetention::Tova);
  ASSERT_EQ(tova.evict_protected_recent(), 1);
  const std::vector<Step> to4(steps.begin(), steps.begin() + 5);
  KvCache c(1, 2, tova);
  EXPECT_EQ(run(tova, to4, &c), (std::vector<int64_t>{0, 1, 2, 4}));
  // The scores are step 4's probabilities alone, summed over both heads.
  const double e6 = std::exp(6.0), den = e6 + 3.0;
  ASSERT_EQ(c.size(), 4);
  for (int64_t s = 0; s < 4; ++s) {
    const double want = c.slot_position(s) == 2 ? 2 * e6 / den : 2 / den;
    EXPECT_NEAR(c.score(s), want, 1e-6) << "slot " << s;
  }
  EXPECT_EQ(run(tova, steps), (std::vector<int64_t>{0, 2, 4, 5}));

  KvConfig h2o;
  h2o.h2o_budget = 4;
  h2o.sinks = 1;
  h2o.recent_fraction = 0.0;  // only the newcomer protected, as tova
  ASSERT_EQ(h2o.evict_protected_recent(), 1);
  EXPECT_EQ(run(h2o, steps), (std::vector<int64_t>{0, 1, 2, 5}));
}

// The documented semantics, simulated naively (double probabilities
// recomputed from the retained keys): same retained set after every token
// and the scores of the latest query, GQA 2 heads per KV head: sinks 0 and
// 3 with only the newcomer protected, and 2 sinks + a protected recent
// quarter (--kv-recent 0.25: R = 3).
TEST(KvTova, MatchesNaiveSimulation) {
  const int64_t nh = 4, nkv = 2, hd = 16, B = 12, T = 150;
  for (int64_t sinks : {int64_t(0), int64_t(3), int64_t(2)}) {
    KvConfig cfg;
    cfg.tova_budget = B;
    cfg.sinks = sinks;
    cfg.recent_set = sinks == 2;
    const int64_t R = sinks == 2 ? 3 : 1;
    ASSERT_EQ(cfg.evict_protected_recent(), R);
    KvCache c(nkv, hd, cfg);
    std::mt19937 rng(33 + uint32_t(sinks));
    std::vector<int64_t> kept;
    std::map<int64_t, double> score;
    std::map<int64_t, Vec> keys;
    for (int64_t p = 0; p < T; ++p) {
      const Vec k = randn(rng, size_t(nkv * hd), 2.0f), v = randn(rng, size_t(nkv * hd));
      keys[p] = k;
      kept.push_back(p);
      if (int64_t(kept.size()) > B) {
        size_t victim = size_t(sinks);
        for (size_t i = victim + 1; i < kept.size() - size_t(R); ++i)
          if (score[kept[i]] < score[kept[victim]]) victim = i;
        kept.erase(kept.begin() + int64_t(victim));
      }
      c.append(p, k.data(), v.data());
      ASSERT_EQ(c.positions(), kept) << "sinks " << sinks << " t=" << p;
      const Vec q = randn(rng, size_t(nh * hd));
      Vec out(q.size());
      c.attend(q.data(), nh, 0.25f, out.data());
      for (int64_t pos : kept) score[pos] = 0;
      for (int64_t h = 0; h < nh; ++h) {
        std::vector<double> s;
        double mx = -1e300, sum = 0;
        for (int64_t pos : kept) {
          double d = 0;
          for (int64_t i = 0; i < hd; ++i) d += double(q[size_t(h * hd + i)]) * keys[pos][size_t((h / 2) * hd + i)];
          s.push_back(d * 0.25);
          mx = std::max(mx, s.back());
        }
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (size_t i = 0; i < kept.size(); ++i) score[kept[i]] += s[i] / sum;
      }
      for (int64_t sl = 0; sl < c.size(); ++sl)
        ASSERT_NEAR(c.score(sl), score[kept[size_t(sl)]], 1e-4) << "sinks " << sinks << " t=" << p;
    }
  }
}

TEST(KvTova, ConfigurationErrorsAndDescription) {
  KvConfig c;
  c.tova_budget = 4;  // sinks 4
  EXPECT_THROW(c.validate(), Error);
  try {
    c.validate();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--kv-tova budget 4 is too small"), std::string::npos) << e.what();
  }
  c.tova_budget = 64;
  c.h2o_budget = 64;
  try {
    c.validate();
    ADD_FAILURE() << "h2o + tova accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exclusive"), std::string::npos) << e.what();
  }
  c.h2o_budget = 0;
  c.recent_set = true;  // --kv-recent 0.25: 16 protected recent positions instead of the newcomer alone
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.evict_protected_recent(), 16);
  EXPECT_EQ(c.describe(), "dtype=f32 tova=64 sinks=4 recent=16");
  c.recent_set = false;
  EXPECT_EQ(c.evict_protected_recent(), 1);
  c.sinks_set = true;
  c.sinks = 0;
  c.window = 16;  // tova wins over a window
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.retention(), KvRetention::Tova);
  EXPECT_EQ(c.capacity(), 64);
  EXPECT_EQ(c.retained(1000), 64);
  EXPECT_EQ(c.describe(), "dtype=f32 tova=64 sinks=0");
}

}  // namespace kv_tova_test
