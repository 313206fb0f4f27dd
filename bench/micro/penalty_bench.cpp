// Penalty cost per token: the old sort/hash versions against Sampler (bench/NOTES.md).
// Build: g++ -std=c++20 -O2 -Isrc bench/micro/penalty_bench.cpp build/libflashmoe_lib.a -o /tmp/penalty_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>
#include "engine/sampler.h"
using namespace flashmoe;
static void old_rep(std::span<float> logits, std::span<const int32_t> history, float penalty) {
  std::vector<int32_t> seen(history.begin(), history.end());
  std::sort(seen.begin(), seen.end());
  seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
  for (int32_t id : seen) { float& l = logits[id]; l = l < 0 ? l * penalty : l / penalty; }
}
static void old_pf(std::span<float> logits, std::span<const int32_t> history, float p, float f) {
  std::unordered_map<int32_t, int> counts;
  for (int32_t id : history) ++counts[id];
  for (auto [id, n] : counts) logits[id] -= p + f * float(n);
}
int main() {
  const size_t V = 248320;
  std::mt19937 rng(1);
  for (size_t n : {1000u, 10000u, 100000u}) {
    std::vector<int32_t> h(n); for (auto& x : h) x = int32_t(rng() % 30000);
    std::vector<float> a(V, 0.5f), b(V, 0.5f);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) { old_rep(a, h, 1.1f); old_pf(a, h, 0.1f, 0.1f); }
    auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) { Sampler::apply_repetition_penalty(b, h, 1.1f); Sampler::apply_presence_frequency(b, h, 0.1f, 0.1f); }
    auto t2 = std::chrono::steady_clock::now();
    double o = std::chrono::duration<double, std::micro>(t1 - t0).count() / 50, w = std::chrono::duration<double, std::micro>(t2 - t1).count() / 50;
    std::printf("history %6zu: sort+hash %8.1f us/token, table %7.1f us/token (x%.1f), same result: %s\n", n, o, w, o / w, a == b ? "yes" : "NO");
  }
}
