// SnapKV (--kv-snapkv B) on the CPU's KvCache: the positions a compressed
// prompt keeps, derived by hand, the window after it, and the memory it
// gives back.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "kv/kv_cache.h"

namespace kv_snapkv_test {

using namespace flashmoe;

namespace {

using Vec = std::vector<float>;
using Pos = std::vector<int64_t>;

// B 5, 1 sink, window R = floor(0.4 x 5) = 2: 2 positions chosen.
KvConfig snap5() {
  KvConfig c;
  c.snapkv_budget = 5;
  c.sinks = 1;
  c.recent_fraction = 0.4;
  c.recent_set = true;
  return c;
}

// A prompt of `keys` (one KV head, head_dim 2), every token attending with
// query q (one query head, scale 1), as the model's prompt path does:
// append, then the queries observed.
KvCache prompt(const KvConfig& cfg, const std::vector<Vec>& keys, const Vec& q) {
  KvCache c(1, 2, cfg);
  const Vec v = {0, 0};
  for (size_t p = 0; p < keys.size(); ++p) c.append(int64_t(p), keys[p].data(), v.data());
  for (size_t p = 0; p < keys.size(); ++p) c.observe_query(q.data(), 1, 1.0f);
  return c;
}

}  // namespace

// Ten prompt positions, key (10, 0) at position 5, zero keys elsewhere;
// every query is (1, 0). Queries t < 5 spread 1/(t+1) over [0, t]; queries
// t >= 5 give position 5 e^10/(e^10 + t) and the others 1/(e^10 + t). So
// score(5) ~ 5, score(0) ~ 2.28, score(1) ~ 1.28, score(2) ~ 0.78,
// score(3) ~ 0.45, score(4) ~ 0.2, score(6..9) ~ 0. Max-pooled over 7:
// candidates 1..7 (not the sink, not the window 8, 9): pooled(1) = score(0)
// ~ 2.28 (its pool [0, 4] misses 5), pooled(2..7) = score(5), a tie broken
// by the own score: 5, then 2. Kept: 0 | 2, 5 | 8, 9.
TEST(KvSnapKv, KeepsWhatTheLastPromptQueriesAttendTo) {
  std::vector<Vec> keys(10, Vec{0, 0});
  keys[5] = {10, 0};
  KvCache c = prompt(snap5(), keys, Vec{1, 0});
  EXPECT_EQ(c.size(), 10);  // the whole prompt until decoding starts
  EXPECT_TRUE(c.supports_prefix_attention());
  c.begin_decode();
  EXPECT_TRUE(c.compressed());
  EXPECT_FALSE(c.supports_prefix_attention());
  EXPECT_EQ(c.positions(), (Pos{0, 2, 5, 8, 9}));
  // The kept rows moved with their positions: slot 2 holds position 5's key.
  Vec k(2), v(2);
  c.dequantize(2, k.data(), v.data());
  EXPECT_EQ(k, (Vec{10, 0}));
  // Decoding: slots 3, 4 are a window, the oldest overwritten first.
  const Vec z = {0, 0};
  c.append(10, z.data(), z.data());
  EXPECT_EQ(c.positions(), (Pos{0, 2, 5, 9, 10}));
  c.append(11, z.data(), z.data());
  EXPECT_EQ(c.positions(), (Pos{0, 2, 5, 10, 11}));
  c.append(12, z.data(), z.data());
  EXPECT_EQ(c.positions(), (Pos{0, 2, 5, 11, 12}));
  c.begin_decode();  // once only
  EXPECT_EQ(c.positions(), (Pos{0, 2, 5, 11, 12}));
}

// Only the last 32 queries count: a prompt of 40 whose first 8 queries look
// at position 20's key (10, 0) and whose last 32 look at position 30's
// (0, 10) keeps 30 and its best neighbour, not 20.
TEST(KvSnapKv, ObservesOnlyTheLastQueries) {
  std::vector<Vec> keys(40, Vec{0, 0});
  keys[20] = {10, 0};
  keys[30] = {0, 10};
  KvCache c(1, 2, snap5());
  const Vec v = {0, 0}, q20 = {1, 0}, q30 = {0, 1};
  for (int64_t p = 0; p < 40; ++p) c.append(p, keys[size_t(p)].data(), v.data());
  for (int64_t p = 0; p < 40; ++p) c.observe_query(p < 8 ? q20.data() : q30.data(), 1, 1.0f);
  c.begin_decode();
  const Pos kept = c.positions();
  ASSERT_EQ(kept.size(), 5u);
  EXPECT_EQ(kept[0], 0);
  EXPECT_NE(std::find(kept.begin(), kept.end(), 30), kept.end());
  EXPECT_EQ(std::find(kept.begin(), kept.end(), 20), kept.end());
  EXPECT_EQ((Pos{kept[3], kept[4]}), (Pos{38, 39}));
}

// A prompt within the budget is kept whole and then fills up to B; after
// that the window share turns over. Memory after compression is B slots.
TEST(KvSnapKv, ShortPromptsFillTheBudgetThenSlide) {
  KvCache c = prompt(snap5(), std::vector<Vec>(3, Vec{1, 1}), Vec{1, 0});
  c.begin_decode();
  EXPECT_EQ(c.positions(), (Pos{0, 1, 2}));
  const Vec z = {0, 0};
  for (int64_t p = 3; p < 6; ++p) c.append(p, z.data(), z.data());
  EXPECT_EQ(c.positions(), (Pos{0, 1, 2, 4, 5}));

  KvConfig big = snap5();
  big.snapkv_budget = 64;
  big.dtype = KvDType::FP8;
  KvCache l(2, 64, big);
  std::vector<float> k(128, 0.5f), q(4 * 64, 0.1f);
  for (int64_t p = 0; p < 1000; ++p) l.append(p, k.data(), k.data());
  for (int64_t p = 0; p < 40; ++p) l.observe_query(q.data(), 4, 0.125f);
  const size_t before = l.bytes();
  l.begin_decode();
  EXPECT_EQ(l.size(), 64);
  EXPECT_LT(l.bytes() * 10, before);  // 64 of 1,000 positions
}

TEST(KvSnapKv, RejectsImpossibleConfigurations) {
  auto msg = [](const KvConfig& c) {
    try {
      c.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  KvConfig small;
  small.snapkv_budget = 5;  // 4 sinks + 2
  EXPECT_NE(msg(small).find("--kv-snapkv budget 5 is too small"), std::string::npos) << msg(small);
  KvConfig both;
  both.snapkv_budget = 256;
  both.window = 64;
  EXPECT_NE(msg(both).find("--kv-snapkv is exclusive"), std::string::npos) << msg(both);
  KvConfig ok;
  ok.snapkv_budget = 256;
  EXPECT_EQ(msg(ok), "(accepted)");
  EXPECT_EQ(ok.snapkv_recent(), 64);
  EXPECT_EQ(ok.retained(4096), 256);
}

}  // namespace kv_snapkv_test
