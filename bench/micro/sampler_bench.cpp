// A sampled token's cost at temperature 0.7 and top_p 0.95 (the server's
// common request) over a 4k (coder-mini) and a 248k (Qwen3.5) vocabulary,
// flat logits N(0, 3) and peaked ones (N(0, 3) times 4): bench/NOTES.md,
// "Session 22". Build and run (from the repository root, after `make`):
//   g++ -std=c++20 -O2 -Isrc bench/micro/sampler_bench.cpp src/engine/sampler.cpp build/libflashmoe_core.a -o /tmp/sampler_bench && /tmp/sampler_bench
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "engine/sampler.h"
using namespace flashmoe;

int main() {
  for (const size_t V : {size_t(4096), size_t(248320)})
    for (const float scale : {1.0f, 4.0f}) {
      std::mt19937 rng(1);
      std::normal_distribution<float> nd(0.0f, 3.0f);
      std::vector<float> logits(V);
      for (auto& x : logits) x = scale * nd(rng);
      SamplingParams p;
      p.temperature = 0.7f;
      p.top_p = 0.95f;
      Sampler s(p);
      const int n = V > 100000 ? 200 : 20000;
      int sink = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) sink += s.sample(logits);
      const auto t1 = std::chrono::steady_clock::now();
      std::printf("V %6zu, logits N(0, 3) x %.0f: %8.1f us a token (%d)\n", V, scale,
                  std::chrono::duration<double, std::micro>(t1 - t0).count() / n, sink % 7);
    }
}
