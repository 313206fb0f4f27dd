// Quest-style retrieval (--kv-resident N --kv-page P) on the CPU's KvCache:
// the pages chosen on hand-made keys, the selection and the attention
// against a brute-force reference (bounds, ranking and softmax recomputed
// naively from the dequantised store), and full attention while the context
// fits in the resident budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kv/kv_cache.h"

namespace kv_quest_test {

using namespace flashmoe;

namespace {

using Vec = std::vector<float>;
using Slots = std::vector<int64_t>;

Vec randn(std::mt19937& rng, size_t n, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

KvConfig quest(int64_t resident, int64_t page, QuestSelect sel = QuestSelect::Head) {
  KvConfig c;
  c.resident = resident;
  c.page = page;
  c.quest_select = sel;
  return c;
}

Slots range(int64_t a, int64_t b) {
  Slots s;
  for (int64_t i = a; i < b; ++i) s.push_back(i);
  return s;
}

// One KV head, head_dim 2, pages of 2: keys given per position, values 0.
KvCache filled(const KvConfig& cfg, const std::vector<Vec>& keys, int64_t nkv = 1) {
  KvCache c(nkv, 2, cfg);
  const Vec v(size_t(2 * nkv), 0.0f);
  for (size_t p = 0; p < keys.size(); ++p) c.append(int64_t(p), keys[p].data(), v.data());
  return c;
}

}  // namespace

// Pages of 2, resident 6: page 0 + one middle page + the newest page (8, 9).
// Middle pages: 1 = {(1,0), (2,0)}: min (1,0) max (2,0); 2 = {(0,3), (0,-1)}:
// min (0,-1) max (0,3); 3 = {(-4,0), (-1,0)}: min (-4,0) max (-1,0).
// U_j(q) = sum_c max(q_c min_c, q_c max_c):
//   q = (1,0):  U = 2, 0, -1 -> page 1;   q = (0,1): U = 0, 3, 0 -> page 2;
//   q = (-1,0): U = -1, 0, 4 -> page 3;   q = (0,0): all 0, a tie -> the newest, page 3.
TEST(KvQuest, ChoosesThePageWithTheHighestKeyBound) {
  const std::vector<Vec> keys = {{0, 0}, {0, 0}, {1, 0}, {2, 0}, {0, 3}, {0, -1}, {-4, 0}, {-1, 0}, {0, 0}, {0, 0}};
  KvCache c = filled(quest(6, 2), keys);
  Vec out(2);
  const struct { Vec q; Slots want; } cases[] = {
      {{1, 0}, {0, 1, 2, 3, 8, 9}},
      {{0, 1}, {0, 1, 4, 5, 8, 9}},
      {{-1, 0}, {0, 1, 6, 7, 8, 9}},
      {{0, 0}, {0, 1, 6, 7, 8, 9}},
  };
  for (const auto& t : cases) {
    c.attend(t.q.data(), 1, 1.0f, out.data());
    EXPECT_EQ(c.quest_selected(0), t.want) << "q = (" << t.q[0] << ", " << t.q[1] << ")";
  }
  // A partial newest page (position 9 not yet there): page 4 = {8} and still
  // one middle page, since (6 - 2 - 1) / 2 = 1.
  KvCache p = filled(quest(6, 2), std::vector<Vec>(keys.begin(), keys.begin() + 9));
  const Vec q = {0, 1};
  p.attend(q.data(), 1, 1.0f, out.data());
  EXPECT_EQ(p.quest_selected(0), (Slots{0, 1, 4, 5, 8}));
  // Resident 8: two middle pages, the two highest bounds for (1,0): 1 and 2.
  KvCache w = filled(quest(8, 2), keys);
  const Vec q10 = {1, 0};
  w.attend(q10.data(), 1, 1.0f, out.data());
  EXPECT_EQ(w.quest_selected(0), (Slots{0, 1, 2, 3, 4, 5, 8, 9}));
}

// --kv-recent 0.375 with resident 8: R = 3, so the pages holding the last 3
// of 10 positions (7, 8, 9: pages 3 and 4) are always read, page 0 too, and
// (8 - 2 - 4) / 2 = 1 middle page by bound: for q = (0, 1), page 2 (U = 3).
TEST(KvQuest, AlwaysReadsTheRecentShare) {
  const std::vector<Vec> keys = {{0, 0}, {0, 0}, {1, 0}, {2, 0}, {0, 3}, {0, -1}, {-4, 0}, {-1, 0}, {0, 0}, {0, 0}};
  KvConfig cfg = quest(8, 2);
  cfg.recent_fraction = 0.375;
  cfg.recent_set = true;
  KvCache c = filled(cfg, keys);
  Vec out(2);
  const Vec q01 = {0, 1}, q10 = {1, 0};
  c.attend(q01.data(), 1, 1.0f, out.data());
  EXPECT_EQ(c.quest_selected(0), (Slots{0, 1, 4, 5, 6, 7, 8, 9}));
  c.attend(q10.data(), 1, 1.0f, out.data());
  EXPECT_EQ(c.quest_selected(0), (Slots{0, 1, 2, 3, 6, 7, 8, 9}));
}

// The bound is an upper bound, not the page's best score: page 1 =
// {(3,0), (0,3)} has U = 6 for q = (1,1) though no key scores above 3, and
// page 2 = {(2,2), (2,2)} scores 4 exactly; Quest takes page 1.
TEST(KvQuest, RanksByTheBoundNotTheBestKey) {
  const std::vector<Vec> keys = {{0, 0}, {0, 0}, {3, 0}, {0, 3}, {2, 2}, {2, 2}, {0, 0}, {0, 0}};
  KvCache c = filled(quest(6, 2), keys);
  const Vec q = {1, 1};
  Vec out(2);
  c.attend(q.data(), 1, 1.0f, out.data());
  EXPECT_EQ(c.quest_selected(0), (Slots{0, 1, 2, 3, 6, 7}));
}

// Two KV heads, one query head each. Head 0's keys favour page 1 for its
// query (1,0), head 1's favour page 2 for its query (0,1). Per-head
// selection gives each its page; per-layer takes the largest bound over both
// heads: page 1 (U = 5 on head 0) beats page 2 (U = 2 on head 1).
TEST(KvQuest, SelectsPerKvHeadOrPerLayer) {
  // Per position: {head 0 key (2), head 1 key (2)}.
  const std::vector<Vec> keys = {{0, 0, 0, 0}, {0, 0, 0, 0}, {5, 0, 0, 0}, {5, 0, 0, 0},
                                 {0, 0, 0, 2}, {0, 0, 0, 2}, {0, 0, 0, 0}, {0, 0, 0, 0}};
  const Vec q = {1, 0, 0, 1};
  Vec out(4);
  KvCache h = filled(quest(6, 2, QuestSelect::Head), keys, 2);
  h.attend(q.data(), 2, 1.0f, out.data());
  EXPECT_EQ(h.quest_selected(0), (Slots{0, 1, 2, 3, 6, 7}));
  EXPECT_EQ(h.quest_selected(1), (Slots{0, 1, 4, 5, 6, 7}));
  KvCache l = filled(quest(6, 2, QuestSelect::Layer), keys, 2);
  l.attend(q.data(), 2, 1.0f, out.data());
  EXPECT_EQ(l.quest_selected(0), (Slots{0, 1, 2, 3, 6, 7}));
  EXPECT_EQ(l.quest_selected(1), (Slots{0, 1, 2, 3, 6, 7}));
}

// Random keys, every step: the selection equals a naive re-derivation
// (bounds from dequantize(), all pages ranked, ties to the newer) and the
// output equals a double-precision softmax over the selected slots.
TEST(KvQuest, MatchesABruteForceReference) {
  const int64_t nkv = 2, hd = 16, nh = 4, G = nh / nkv, P = 8, N = 40, steps = 130;
  for (KvDType dt : {KvDType::F32, KvDType::FP8}) {
    for (QuestSelect qs : {QuestSelect::Head, QuestSelect::Layer}) {
     for (double recent : {0.0, 0.5}) {  // 0.5: the last 20 positions always read
      KvConfig cfg = quest(N, P, qs);
      if (recent > 0) {
        cfg.recent_fraction = recent;
        cfg.recent_set = true;
      }
      const int64_t R = int64_t(recent * double(N));
      cfg.dtype = dt;
      cfg.fp8_scale = Fp8ScaleMode::Head;
      KvCache c(nkv, hd, cfg);
      std::mt19937 rng(7);
      std::vector<Vec> K, V;  // dequantised store
      Vec out(size_t(nh * hd)), kd(size_t(nkv * hd)), vd(size_t(nkv * hd));
      for (int64_t p = 0; p < steps; ++p) {
        const Vec k = randn(rng, size_t(nkv * hd)), v = randn(rng, size_t(nkv * hd)), q = randn(rng, size_t(nh * hd));
        c.append(p, k.data(), v.data());
        c.dequantize(p, kd.data(), vd.data());
        K.push_back(kd);
        V.push_back(vd);
        c.attend(q.data(), nh, 0.25f, out.data());
        const int64_t n = p + 1, pages = (n + P - 1) / P, recent0 = (n - std::max<int64_t>(1, R)) / P;
        for (int64_t kvh = 0; kvh < nkv; ++kvh) {
          Slots want;
          if (n <= N) {
            want = range(0, n);
          } else {
            // Bound of page j for head h, the largest over the heads choosing together.
            auto bound = [&](int64_t j, int64_t h) {
              const int64_t kh = h / G;
              double u = 0;
              for (int64_t ch = 0; ch < hd; ++ch) {
                float mn = INFINITY, mx = -INFINITY;
                for (int64_t s = j * P; s < std::min(n, (j + 1) * P); ++s) {
                  mn = std::min(mn, K[size_t(s)][size_t(kh * hd + ch)]);
                  mx = std::max(mx, K[size_t(s)][size_t(kh * hd + ch)]);
                }
                u += std::max(double(q[size_t(h * hd + ch)]) * mn, double(q[size_t(h * hd + ch)]) * mx);
              }
              return u;
            };
            std::vector<std::pair<double, int64_t>> rank;
            for (int64_t j = 1; j < recent0; ++j) {
              double b = -INFINITY;
              for (int64_t h = qs == QuestSelect::Head ? kvh * G : 0; h < (qs == QuestSelect::Head ? (kvh + 1) * G : nh); ++h)
                b = std::max(b, bound(j, h));
              rank.push_back({b, j});
            }
            std::sort(rank.begin(), rank.end(), [](auto a, auto b) { return a.first != b.first ? a.first > b.first : a.second > b.second; });
            const int64_t take = std::min<int64_t>(int64_t(rank.size()), (N - P - (n - recent0 * P)) / P);
            std::vector<int64_t> pick = {0};
            for (int64_t j = recent0; j < pages; ++j) pick.push_back(j);
            for (int64_t i = 0; i < take; ++i) pick.push_back(rank[size_t(i)].second);
            std::sort(pick.begin(), pick.end());
            for (int64_t j : pick) for (int64_t s = j * P; s < std::min(n, (j + 1) * P); ++s) want.push_back(s);
            ASSERT_LE(int64_t(want.size()), N);
          }
          // float rounding of the bound sums could reorder near-ties; the
          // random data here has none within 1e-4 (checked by the equality).
          ASSERT_EQ(c.quest_selected(kvh), want) << "dtype " << kv_dtype_name(dt) << " step " << p << " kv head " << kvh;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            std::vector<double> sc;
            double mx = -INFINITY;
            for (int64_t s : want) {
              double d = 0;
              for (int64_t ch = 0; ch < hd; ++ch) d += double(q[size_t(h * hd + ch)]) * K[size_t(s)][size_t(kvh * hd + ch)];
              sc.push_back(d * 0.25);
              mx = std::max(mx, d * 0.25);
            }
            double z = 0;
            for (double& x : sc) z += (x = std::exp(x - mx));
            for (int64_t ch = 0; ch < hd; ++ch) {
              double o = 0;
              for (size_t i = 0; i < want.size(); ++i) o += sc[i] / z * V[size_t(want[i])][size_t(kvh * hd + ch)];
              ASSERT_NEAR(out[size_t(h * hd + ch)], o, 2e-5) << "step " << p << " head " << h;
            }
          }
        }
      }
     }
    }
  }
}

// While the context fits in the resident budget Quest is the full cache, bit
// for bit, for every storage type (rotated fp8 included).
TEST(KvQuest, EqualsFullAttentionWhenTheContextFits) {
  const int64_t nkv = 2, hd = 16, nh = 4, steps = 48;
  struct D { KvDType t; Fp8ScaleMode s; };
  for (D d : {D{KvDType::F32, Fp8ScaleMode::Position}, D{KvDType::BF16, Fp8ScaleMode::Position},
              D{KvDType::FP8, Fp8ScaleMode::Head}, D{KvDType::FP8, Fp8ScaleMode::Rotated}}) {
    KvConfig full;
    full.dtype = d.t;
    full.fp8_scale = d.s;
    KvConfig q = quest(steps, 16);
    q.dtype = d.t;
    q.fp8_scale = d.s;
    KvCache a(nkv, hd, full), b(nkv, hd, q);
    std::mt19937 rng(3);
    Vec oa(size_t(nh * hd)), ob(size_t(nh * hd));
    for (int64_t p = 0; p < steps; ++p) {
      const Vec k = randn(rng, size_t(nkv * hd)), v = randn(rng, size_t(nkv * hd)), qq = randn(rng, size_t(nh * hd));
      a.append(p, k.data(), v.data());
      b.append(p, k.data(), v.data());
      a.attend(qq.data(), nh, 0.25f, oa.data());
      b.attend(qq.data(), nh, 0.25f, ob.data());
      ASSERT_EQ(oa, ob) << kv_dtype_name(d.t) << " step " << p;
    }
    EXPECT_EQ(b.quest_selected(0), range(0, steps));
    EXPECT_EQ(b.size(), steps);  // nothing evicted
  }
}

TEST(KvQuest, RejectsImpossibleConfigurations) {
  auto msg = [](const KvConfig& c) {
    try {
      c.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  KvConfig small = quest(31, 16);
  EXPECT_NE(msg(small).find("--kv-resident 31 is too small for pages of 16"), std::string::npos) << msg(small);
  KvConfig win = quest(256, 16);
  win.window = 128;
  EXPECT_NE(msg(win).find("--kv-resident is exclusive with --kv-window"), std::string::npos) << msg(win);
  KvConfig page;
  page.page_set = true;
  EXPECT_NE(msg(page).find("--kv-page and --kv-page-select need --kv-resident"), std::string::npos) << msg(page);
  EXPECT_EQ(msg(quest(32, 16)), "(accepted)");
  KvConfig rec = quest(64, 16);
  rec.recent_set = true;
  rec.recent_fraction = 0.75;  // 48 recent + 2 pages of 16 > 64
  EXPECT_NE(msg(rec).find("the recent 48 positions and two pages of 16 must fit, at least 80"), std::string::npos) << msg(rec);
  rec.recent_fraction = 0.5;
  EXPECT_EQ(msg(rec), "(accepted)");
  EXPECT_EQ(quest(256, 16).retained(4096), 4096);  // every position stays stored
  EXPECT_EQ(quest(256, 16).resident_positions(4096), 256);
}

}  // namespace kv_quest_test
