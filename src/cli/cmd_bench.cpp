// flashmoe bench: llama-bench style prompt-processing (pp) and token-
// generation (tg) speed, plus what decode achieves of the memory bandwidth.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "cli/command.h"
#include "cli/common.h"
#include "engine/session.h"
#include "model/weight_bytes.h"

namespace flashmoe::cli {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Stat {
  double mean = 0, sd = 0;
};
Stat stats(const std::vector<double>& v) {
  Stat s;
  for (double x : v) s.mean += x;
  s.mean /= double(v.size());
  for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(s.sd / double(v.size() - 1)) : 0.0;
  return s;
}

// Plain memcpy bandwidth over buffers far larger than the caches, on
// `threads` threads: the ceiling a memory-bound decode can approach.
double memcpy_gbps(ThreadPool& pool) {
  const size_t bytes = size_t(256) << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  auto copy = [&] {
    pool.parallel_for(int64_t(bytes >> 20), [&](int64_t b0, int64_t b1) {
      std::memcpy(b.data() + (b0 << 20), a.data() + (b0 << 20), size_t(b1 - b0) << 20);
    });
  };
  copy();
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    auto t = Clock::now();
    copy();
    best = std::min(best, seconds_since(t));
  }
  return double(bytes) / best / 1e9;  // bytes copied per second (each read once, written once)
}

Registrar reg(40, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Measure prompt processing (pp) and generation (tg) speed");
  auto opt = std::make_shared<ModelOptions>();
  auto pp = std::make_shared<int>(512);
  auto tg = std::make_shared<int>(128);
  auto reps = std::make_shared<int>(3);
  add_model_options(cmd, opt.get());
  cmd->add_option("-p,--n-prompt", *pp, "Prompt tokens for the pp test (0: skip)")->check(CLI::NonNegativeNumber);
  cmd->add_option("-n,--n-gen", *tg, "Generated tokens for the tg test (0: skip)")->check(CLI::NonNegativeNumber);
  cmd->add_option("-r,--repetitions", *reps, "Repetitions of each test")->check(CLI::PositiveNumber);
  cmd->callback([=] {
    finalize_model_options(opt.get());
    auto model = QwenModel::load(opt->model_dir, opt->experts);
    ThreadPool pool(opt->threads);
    const ModelConfig& c = model->config();
    WeightBytes wb = count_weight_bytes(c, model->weights());
    std::mt19937 rng(1234);
    std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size - 1));
    std::printf("model: %s (%s, %lld layers, %.1f MB of weights)\nthreads: %d\n", opt->model_dir.c_str(),
                c.model_type.c_str(), (long long)c.num_layers, double(wb.total) / 1e6, pool.size());
    std::printf("| test  | tokens/s (mean ± sd) |\n|-------|----------------------|\n");
    if (*pp > 0) {
      std::vector<double> rate;
      std::vector<int32_t> ids(static_cast<size_t>(*pp));
      for (auto& i : ids) i = tok(rng);
      Session warm(*model, opt->kv, pool);
      warm.feed(std::vector<int32_t>(ids.begin(), ids.begin() + std::min<size_t>(ids.size(), 16)));
      for (int r = 0; r < *reps; ++r) {
        Session s(*model, opt->kv, pool);
        auto t = Clock::now();
        s.feed(ids);
        rate.push_back(double(*pp) / seconds_since(t));
      }
      Stat st = stats(rate);
      std::printf("| pp%-3d | %9.1f ± %-8.1f |\n", *pp, st.mean, st.sd);
    }
    if (*tg > 0) {
      std::vector<double> rate;
      for (int r = 0; r < *reps + 1; ++r) {  // first run warms caches and pages
        Session s(*model, opt->kv, pool);
        int32_t next = tok(rng);
        auto t = Clock::now();
        for (int i = 0; i < *tg; ++i) next = argmax(s.feed({next}).data(), c.vocab_size);
        if (r > 0) rate.push_back(double(*tg) / seconds_since(t));
      }
      Stat st = stats(rate);
      std::printf("| tg%-3d | %9.1f ± %-8.1f |\n", *tg, st.mean, st.sd);
      double gbps = st.mean * double(wb.per_token) / 1e9;
      double copy = memcpy_gbps(pool);
      std::printf("decode reads %.2f MB of weights per token -> %.2f GB/s; memcpy on %d threads: %.2f GB/s "
                  "(%.0f%% of it)\n",
                  double(wb.per_token) / 1e6, gbps, pool.size(), copy, 100.0 * gbps / copy);
    }
  });
});

}  // namespace
}  // namespace flashmoe::cli
