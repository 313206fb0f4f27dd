// A sampled token's cost with top_p (the server's default sampling:
// temperature 0.7, top_p 0.95): the old candidates() that sorted the whole
// filtered vocabulary against Sampler::sample now, side by side on the same
// logits (that both pick the same ids: the test
// Sampler.CandidatesEqualAFullSortOfTheVocabulary; bench/NOTES.md, "The CPU
// server's 8 clients").
// Build: g++ -std=c++20 -O2 -Isrc bench/micro/top_p_bench.cpp src/engine/sampler.cpp build/libflashmoe_core.a \
//   -o /tmp/top_p_bench
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"
using namespace flashmoe;
using Clock = std::chrono::steady_clock;

// The draw of the old Sampler::sample with top_p: candidates() sorting all
// ids above the eps filter, then the nucleus, renormalised, then draw().
static int32_t old_sample(const std::vector<float>& l, float temperature, float top_p, double u) {
  const float inv_t = 1.0f / temperature, max_l = *std::max_element(l.begin(), l.end());
  std::vector<std::pair<int32_t, float>> c;
  c.reserve(l.size());
  double sum = 0;
  for (size_t i = 0; i < l.size(); ++i) {
    const float e = std::exp((l[i] - max_l) * inv_t);
    sum += e;
    c.emplace_back(int32_t(i), e);
  }
  for (auto& x : c) x.second = float(x.second / sum);
  auto by = [](const auto& a, const auto& b) { return a.second != b.second ? a.second > b.second : a.first < b.first; };
  const float eps = (1.0f - top_p) / float(l.size());
  c.erase(std::remove_if(c.begin(), c.end(), [&](const auto& x) { return x.second < eps; }), c.end());
  std::sort(c.begin(), c.end(), by);
  double cum = 0;
  size_t keep = 0;
  while (keep < c.size() && (keep == 0 || cum < top_p)) cum += c[keep++].second;
  c.resize(keep);
  double s = 0;
  for (auto& x : c) s += x.second;
  cum = 0;
  for (auto& x : c) {
    cum += double(float(x.second / s));
    if (u < cum) return x.first;
  }
  return c.back().first;
}

// 16 rows of V logits, normal with this sd.
static std::vector<std::vector<float>> rows_of(size_t V, float sd) {
  std::mt19937 g(7);
  std::normal_distribution<float> d(0, sd);
  std::vector<std::vector<float>> rows(16, std::vector<float>(V));
  for (auto& r : rows)
    for (auto& x : r) x = d(g);
  return rows;
}

// `top_p_bench old|new|none V SD REPS`: only that many draws of one kind,
// untimed, for an instruction count that the machine's load cannot blur
// (valgrind --tool=callgrind; "none" counts the set-up alone).
static int count_only(char** argv) {
  const std::string mode = argv[1];
  const size_t V = std::stoul(argv[2]);
  const auto rows = rows_of(V, std::stof(argv[3]));
  const int reps = std::stoi(argv[4]);
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_p = 0.95f;
  Sampler s(p);
  int64_t check = 0;
  for (int i = 0; i < reps; ++i) {
    const auto& l = rows[size_t(i) % rows.size()];
    if (mode == "old") check += old_sample(l, 0.7f, 0.95f, 0.5);
    else if (mode == "new") check += s.sample(l);
  }
  std::printf("%s %lld\n", mode.c_str(), (long long)check);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 5) return count_only(argv);
  for (size_t V : {4096u, 151936u, 248320u})
    for (float sd : {1.0f, 3.0f}) {  // flat and peaked logits (normal, this sd)
      const auto rows = rows_of(V, sd);
      SamplingParams p;
      p.temperature = 0.7f;
      p.top_p = 0.95f;
      const int reps = V > 10000 ? 64 : 2048;
      double best_old = 1e30, best_new = 1e30;
      int64_t check = 0;
      for (int round = 0; round < 3; ++round) {  // interleaved, best of 3
        std::mt19937_64 ug(1);
        auto t = Clock::now();
        for (int i = 0; i < reps; ++i) check += old_sample(rows[size_t(i) % rows.size()], 0.7f, 0.95f, double(ug() >> 11) * 0x1p-53);
        best_old = std::min(best_old, std::chrono::duration<double>(Clock::now() - t).count() / reps);
        Sampler s(p);
        t = Clock::now();
        for (int i = 0; i < reps; ++i) check -= s.sample(rows[size_t(i) % rows.size()]);
        best_new = std::min(best_new, std::chrono::duration<double>(Clock::now() - t).count() / reps);
      }
      const size_t nucleus = Sampler::candidates(rows[0], p).size();
      std::printf("V %6zu, logits sd %.0f (nucleus %zu ids): full sort %8.1f us, by chunks %8.1f us per token (%.1fx)\n",
                  V, sd, nucleus, best_old * 1e6, best_new * 1e6, best_old / best_new);
      if (check == INT64_MIN) std::printf("\n");  // keeps the draws
    }
}
