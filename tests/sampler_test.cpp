// Sampler and stop-string behaviour on hand-made distributions whose right
// answers can be worked out on paper.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <set>

#include "core/error.h"
#include "engine/sampler.h"
#include "engine/stop.h"

namespace sampler_test {

using namespace flashmoe;

namespace {

// Logits whose softmax is exactly `probs` (log of each probability).
std::vector<float> logits_for(const std::vector<float>& probs) {
  std::vector<float> l;
  for (float p : probs) l.push_back(std::log(p));
  return l;
}

std::set<int32_t> ids_of(const std::vector<std::pair<int32_t, float>>& c) {
  std::set<int32_t> s;
  for (auto& x : c) s.insert(x.first);
  return s;
}

std::vector<float> random_logits(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0, 3);
  std::vector<float> l(n);
  for (auto& x : l) x = d(g);
  return l;
}

}  // namespace

TEST(Sampler, GreedyIsArgmax) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p);
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const auto l = random_logits(1000, seed);
    EXPECT_EQ(s.sample(l), int32_t(std::max_element(l.begin(), l.end()) - l.begin()));
  }
  EXPECT_EQ(s.sample(std::vector<float>{1, 5, 5, 2}), 1);  // first index on ties
}

// is_plain_greedy: true exactly when a draw is the argmax of the logits as
// they come; each setting that changes the pick (temperature, a bias, a
// penalty over a history) turns it off, and with it on the sampler's pick
// over a history is still the bare argmax.
TEST(Sampler, PlainGreedyMeansTheArgmaxOfTheLogitsAsTheyCome) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_TRUE(p.is_plain_greedy());
  const auto l = random_logits(300, 5);
  const int32_t best = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
  const std::vector<int32_t> history = {best, best, 3};
  EXPECT_EQ(Sampler(p).sample(l, history), best);
  SamplingParams q = p;
  q.temperature = 0.7f;
  EXPECT_FALSE(q.is_plain_greedy());
  q = p;
  q.logit_bias = {{best, -100.0f}};
  EXPECT_FALSE(q.is_plain_greedy());
  EXPECT_NE(Sampler(q).sample(l), best);  // the bias moves the pick: an argmax of the raw logits would be wrong
  q = p;
  q.repetition_penalty = 100.0f;
  EXPECT_FALSE(q.is_plain_greedy());
  q = p;
  q.presence_penalty = 1.0f;
  EXPECT_FALSE(q.is_plain_greedy());
  q = p;
  q.frequency_penalty = 1.0f;
  EXPECT_FALSE(q.is_plain_greedy());
  q = p;
  q.top_k = 5, q.top_p = 0.5f, q.min_p = 0.1f, q.seed = 9;  // no effect on a greedy pick
  EXPECT_TRUE(q.is_plain_greedy());
  EXPECT_EQ(Sampler(q).sample(l, history), best);
}

// sample() without a filter (no top-k / top-p / min-p) orders the vocabulary
// only as far as its walk goes; it must draw exactly what draw(distribution())
// draws from the fully sorted candidates: the same token for the same seed,
// over flat and peaked logits, ties (logits on a coarse grid), masked tokens
// (-inf), a hot temperature whose walk reaches past the first chunks, and
// the penalties and bias.
TEST(Sampler, UnfilteredSampleDrawsAsTheSortedDistribution) {
  struct Case {
    size_t V;
    float scale, temperature;
    bool grid, masked, penalties;
  };
  const std::vector<int32_t> history = {3, 3, 7, 11, 200};
  int drawn_past_first_chunk = 0;
  for (const Case c : {Case{2, 1, 1, false, false, false}, Case{5, 3, 0.7f, true, false, false},
                       Case{300, 3, 0.7f, false, true, false}, Case{4096, 3, 0.7f, false, false, true},
                       Case{4096, 1, 2.0f, true, true, false}, Case{8192, 0.5f, 1.5f, false, false, false}}) {
    std::vector<float> l = random_logits(c.V, uint32_t(c.V));
    if (c.grid)
      for (auto& x : l) x = std::round(x * 2) / 2;  // many exact ties
    if (c.masked)
      for (size_t i = 0; i < l.size(); i += 3) l[i] = -INFINITY;
    for (auto& x : l) x *= c.scale;
    SamplingParams p;
    p.temperature = c.temperature;
    if (c.penalties) {
      p.repetition_penalty = 1.3f;
      p.presence_penalty = 0.5f;
      p.logit_bias = {{1, 2.0f}, {2, -100.0f}};
    }
    for (uint64_t seed : {1, 2, 3}) {
      p.seed = seed;
      Sampler fast(p), ref(p);
      for (int i = 0; i < 20; ++i) {
        const auto d = ref.distribution(l, history);
        const int32_t want = ref.draw(d), got = fast.sample(l, history);
        ASSERT_EQ(got, want) << "V " << c.V << ", temperature " << c.temperature << ", seed " << seed << ", draw " << i;
        size_t rank = 0;
        while (d[rank].first != want) ++rank;
        drawn_past_first_chunk += rank >= 64 ? 1 : 0;
      }
    }
  }
  EXPECT_GT(drawn_past_first_chunk, 0);  // the walk did go on past the first chunk
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedDiffers) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1234;
  const auto l = random_logits(500, 7);
  std::vector<int32_t> a, b, c;
  Sampler s1(p), s2(p);
  p.seed = 99;
  Sampler s3(p);
  for (int i = 0; i < 200; ++i) {
    a.push_back(s1.sample(l));
    b.push_back(s2.sample(l));
    c.push_back(s3.sample(l));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_GT(std::set<int32_t>(a.begin(), a.end()).size(), 5u);  // really sampling
}

TEST(Sampler, TopKOneEqualsGreedy) {
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 1;
  p.seed = 3;
  Sampler s(p);
  for (uint32_t seed = 0; seed < 50; ++seed) {
    const auto l = random_logits(300, seed);
    EXPECT_EQ(s.sample(l), int32_t(std::max_element(l.begin(), l.end()) - l.begin()));
  }
}

TEST(Sampler, TopKKeepsTheKLargest) {
  SamplingParams p;
  p.top_k = 2;
  const auto c = Sampler::candidates(logits_for({0.1f, 0.4f, 0.2f, 0.3f}), p);
  EXPECT_EQ(ids_of(c), (std::set<int32_t>{1, 3}));
  EXPECT_NEAR(c[0].second, 0.4f / 0.7f, 1e-5);
}

TEST(Sampler, TopPKeepsSmallestNucleus) {
  // Sorted: 0.5 (id 2), 0.25 (id 0), 0.15 (id 3), 0.1 (id 1).
  const auto l = logits_for({0.25f, 0.1f, 0.5f, 0.15f});
  SamplingParams p;
  p.top_p = 0.7f;  // 0.5 < 0.7, 0.75 >= 0.7: ids {2, 0}
  EXPECT_EQ(ids_of(Sampler::candidates(l, p)), (std::set<int32_t>{0, 2}));
  p.top_p = 0.8f;  // needs 0.9: ids {2, 0, 3}
  EXPECT_EQ(ids_of(Sampler::candidates(l, p)), (std::set<int32_t>{0, 2, 3}));
  p.top_p = 0.4f;  // the top token alone
  const auto c = Sampler::candidates(l, p);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].first, 2);
  EXPECT_FLOAT_EQ(c[0].second, 1.0f);
  // Sampling with top_p never returns an excluded token.
  p.top_p = 0.7f;
  p.seed = 5;
  Sampler s(p);
  for (int i = 0; i < 300; ++i) {
    const int32_t t = s.sample(l);
    EXPECT_TRUE(t == 0 || t == 2) << t;
  }
}

// Top-p over a vocabulary of 4,096 (the candidates never made for tokens
// below (1 - top_p) / V): the same candidates, in the same order and with
// the same probabilities, as the whole softmax sorted and cut by hand.
TEST(Sampler, TopPOverALargeVocabularyEqualsTheWholeSoftmaxCut) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 2.5f);
  std::vector<float> l(4096);
  for (auto& x : l) x = nd(rng);
  for (const float top_p : {0.5f, 0.9f, 0.95f, 0.999f}) {
    SamplingParams p;
    p.temperature = 0.7f;
    p.top_p = top_p;
    const float max_l = *std::max_element(l.begin(), l.end());
    std::vector<float> e(l.size());
    double sum = 0;
    for (size_t i = 0; i < l.size(); ++i) sum += e[i] = std::exp((l[i] - max_l) * (1.0f / p.temperature));
    std::vector<std::pair<int32_t, float>> want;
    for (size_t i = 0; i < l.size(); ++i) want.emplace_back(int32_t(i), float(e[i] / sum));
    std::sort(want.begin(), want.end(),
              [](const auto& a, const auto& b) { return a.second != b.second ? a.second > b.second : a.first < b.first; });
    double cum = 0;
    size_t keep = 0;
    while (keep < want.size() && (keep == 0 || cum < top_p)) cum += want[keep++].second;
    want.resize(keep);
    double kept = 0;
    for (const auto& x : want) kept += x.second;
    for (auto& x : want) x.second = float(x.second / kept);
    const auto got = Sampler::candidates(l, p);
    ASSERT_EQ(got.size(), want.size()) << "top_p " << top_p;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, want[i].first) << "top_p " << top_p << " rank " << i;
      EXPECT_EQ(got[i].second, want[i].second) << "top_p " << top_p << " rank " << i;
    }
    EXPECT_GT(want.size(), 10u) << "top_p " << top_p << ": a nucleus of many tokens";
  }
}

TEST(Sampler, MinPDropsTokensBelowFractionOfTop) {
  const auto l = logits_for({0.5f, 0.3f, 0.12f, 0.08f});
  SamplingParams p;
  p.min_p = 0.2f;  // cut = 0.1: keeps 0.5, 0.3, 0.12
  EXPECT_EQ(ids_of(Sampler::candidates(l, p)), (std::set<int32_t>{0, 1, 2}));
  p.min_p = 0.5f;  // cut = 0.25
  const auto c = Sampler::candidates(l, p);
  EXPECT_EQ(ids_of(c), (std::set<int32_t>{0, 1}));
  EXPECT_NEAR(c[0].second, 0.5f / 0.8f, 1e-5);
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  const auto l = logits_for({0.6f, 0.4f});
  SamplingParams p;
  p.temperature = 0.5f;  // p ∝ 0.6^2 : 0.4^2
  auto c = Sampler::candidates(l, p);
  EXPECT_NEAR(c[0].second, 0.36f / 0.52f, 1e-5);
  p.temperature = 2.0f;  // p ∝ sqrt
  c = Sampler::candidates(l, p);
  EXPECT_NEAR(c[0].second, std::sqrt(0.6f) / (std::sqrt(0.6f) + std::sqrt(0.4f)), 1e-5);
}

TEST(Sampler, RepetitionPenaltyHfSemantics) {
  std::vector<float> l = {2.0f, -2.0f, 1.0f, 0.5f};
  const std::vector<int32_t> hist = {0, 1, 1, 0};
  Sampler::apply_repetition_penalty(l, hist, 2.0f);
  EXPECT_FLOAT_EQ(l[0], 1.0f);   // positive: divided (once, despite two occurrences)
  EXPECT_FLOAT_EQ(l[1], -4.0f);  // negative: multiplied
  EXPECT_FLOAT_EQ(l[2], 1.0f);   // unseen: unchanged
  EXPECT_FLOAT_EQ(l[3], 0.5f);
}

TEST(Sampler, PresenceAndFrequencyPenaltyOpenAiSemantics) {
  std::vector<float> l = {2.0f, -2.0f, 1.0f};
  const std::vector<int32_t> hist = {0, 0, 0, 1};
  Sampler::apply_presence_frequency(l, hist, 0.5f, 0.0f);
  EXPECT_FLOAT_EQ(l[0], 1.5f);  // once, however often seen
  EXPECT_FLOAT_EQ(l[1], -2.5f);
  EXPECT_FLOAT_EQ(l[2], 1.0f);
  Sampler::apply_presence_frequency(l, hist, 0.0f, 0.25f);
  EXPECT_FLOAT_EQ(l[0], 0.75f);  // 3 occurrences
  EXPECT_FLOAT_EQ(l[1], -2.75f);
}

TEST(Sampler, PenaltiesChangeTheGreedyChoice) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 3.0f;
  Sampler s(p);
  const std::vector<float> l = {3.0f, 2.0f};
  EXPECT_EQ(s.sample(l), 0);
  const std::vector<int32_t> hist = {0};
  EXPECT_EQ(s.sample(l, hist), 1);  // 3 / 3 = 1 < 2
}

TEST(Sampler, GenerationConfigDefaults) {
  const std::string dir = ::testing::TempDir();
  const std::string f = dir + "/generation_config.json";
  std::ofstream(f) << R"({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [151645, 151643], "do_sample": true})";
  const SamplingParams p = load_generation_config(f);
  EXPECT_FLOAT_EQ(p.temperature, 0.6f);
  EXPECT_FLOAT_EQ(p.top_p, 0.95f);
  EXPECT_EQ(p.top_k, 20);
  EXPECT_EQ(p.eos_ids, (std::vector<int32_t>{151645, 151643}));
  const SamplingParams q = load_generation_config(std::string(FLASHMOE_SOURCE_DIR) + "/models/coder-mini/model");
  EXPECT_EQ(q.eos_ids, (std::vector<int32_t>{4091}));
  EXPECT_FLOAT_EQ(q.temperature, 1.0f);  // not in the file: default kept
  SamplingParams base;
  base.temperature = 0.3f;
  EXPECT_FLOAT_EQ(load_generation_config("/nonexistent", base).temperature, 0.3f);
  std::ofstream(f) << "{broken";
  EXPECT_THROW(load_generation_config(f), Error);
}

TEST(StopMatcher, HoldsBackPartialStopAndCutsAtStop) {
  StopMatcher m({"<|im_end|>", "STOP"});
  auto r = m.feed("Hello <|im");
  EXPECT_EQ(r.text, "Hello ");
  EXPECT_FALSE(r.stopped);
  EXPECT_EQ(m.held_bytes(), 4u);
  r = m.feed("_en");
  EXPECT_EQ(r.text, "");
  r = m.feed("d|> trailing");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");
  EXPECT_EQ(r.which, 0);
  EXPECT_EQ(m.feed("more").text, "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, ReleasesFalseAlarmsAndFlushes) {
  StopMatcher m({"<|im_end|>"});
  EXPECT_EQ(m.feed("a <|im").text, "a ");
  EXPECT_EQ(m.feed("_start|> b").text, "<|im_start|> b");  // not a stop after all
  EXPECT_EQ(m.feed("x<").text, "x");
  EXPECT_EQ(m.flush(), "<");  // end of generation: held text released
  StopMatcher n({"STOP", "TO"});
  auto r = n.feed("aSTOPb");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "a");  // earliest occurrence wins
  EXPECT_EQ(r.which, 0);
  StopMatcher none({});
  EXPECT_EQ(none.feed("<|im_end|>").text, "<|im_end|>");
}

TEST(StopMatcher, StopSpanningManySmallChunks) {
  StopMatcher m({"\n\nUser:"});
  std::string emitted;
  const std::string stream = "answer\n\nUse it\n\nUser: next";
  bool stopped = false;
  for (char c : stream) {
    auto r = m.feed(std::string(1, c));
    emitted += r.text;
    if (r.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(emitted, "answer\n\nUse it");
}

}  // namespace sampler_test
