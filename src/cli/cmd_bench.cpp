// flashmoe bench: llama-bench style prompt-processing (pp) and token-
// generation (tg) speed, plus what decode achieves of the memory bandwidth.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "backend/cuda/cuda_bench.h"
#include "cli/command.h"
#include "cli/common.h"
#include "cli/device.h"
#include "core/error.h"
#include "engine/session.h"
#include "experts/expert_layout.h"
#include "kv/presets.h"
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

// A model of a published size with random bf16 weights, built on the device.
std::unique_ptr<CudaModel> synthetic_model(const ModelOptions& opt, const std::string& preset, int layers,
                                           const std::string& experts, int group, std::string* what) {
  if (opt.device == "cpu")
    fail(!opt.device_auto ? "bench: --synthetic needs --device cuda (or auto)"
         : !opt.cpu_note.empty() ? "bench: --synthetic needs the GPU, and this run is on the CPU: " + opt.cpu_note
                                 : "bench: --synthetic needs a usable GPU (" + opt.no_gpu + ")");
  std::string why;
  if (!CudaModel::available(&why)) fail(device_words(opt) + ": no usable GPU (" + why + "); use --device cpu");
  ModelConfig c = model_preset(preset);
  if (layers > 0 && layers < c.num_layers) {
    c.num_layers = layers;
    c.layer_kinds.resize(size_t(layers));
    c.layer_is_moe.resize(size_t(layers));
  }
  CudaSyntheticOptions so;
  so.experts = parse_expert_format(experts, "bench --experts");
  so.group = group;
  *what = "synthetic " + preset + " (random bf16 weights" +
          (so.experts == QuantKind::None ? std::string()
                                                   : ", " + experts + " experts in groups of " + std::to_string(group)) +
          ", " + std::to_string(c.num_layers) + " layers)";
  return cuda_synthetic_model(c, 1234, opt.cuda, so);
}

// "| tg128 |" or, at a context depth, "| tg128 @ d4096 |" (llama-bench's naming).
void print_tg(int tg, int depth, const Stat& st) {
  if (depth > 0) std::printf("| tg%d @ d%d | %9.1f ± %-8.1f |\n", tg, depth, st.mean, st.sd);
  else std::printf("| tg%-3d | %9.1f ± %-8.1f |\n", tg, st.mean, st.sd);
}

// GPU path: prompt processing through CudaModel::forward, generation
// through decode_greedy (graph replays, no host round trip per token).
void bench_cuda(const ModelOptions& opt, CudaModel* cm, const std::string& what, int pp, int tg, int depth, int reps,
                bool no_graph, int profile_steps) {
  cm->set_use_graph(!no_graph);
  const ModelConfig& c = cm->config();
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size - 1));
  std::printf("model: %s (%s, %lld layers, %.2f GB of weights on %s)\nkv: %s; cuda graph: %s\n", what.c_str(),
              c.model_type.c_str(), (long long)c.num_layers, double(cm->weight_bytes_total()) / 1e9,
              cm->device_name().c_str(), opt.kv.describe().c_str(), no_graph ? "off" : "on");
  std::printf("| test  | tokens/s (mean ± sd) |\n|-------|----------------------|\n");
  std::vector<float> logits(size_t(c.vocab_size));
  if (pp > 0) {
    std::vector<double> rate;
    std::vector<int32_t> ids(static_cast<size_t>(pp));
    for (auto& i : ids) i = tok(rng);
    {
      auto warm = cm->new_state(opt.kv);
      cm->forward(*warm, ids.data(), std::min<int64_t>(pp, 16), LogitsMode::Last, logits.data());
    }
    for (int r = 0; r < reps; ++r) {
      auto st = cm->new_state(opt.kv);
      auto t = Clock::now();
      cm->forward(*st, ids.data(), pp, LogitsMode::Last, logits.data());
      rate.push_back(double(pp) / seconds_since(t));
    }
    Stat st = stats(rate);
    std::printf("| pp%-3d | %9.1f ± %-8.1f |\n", pp, st.mean, st.sd);
  }
  if (tg > 0) {
    std::vector<double> rate;
    std::vector<int32_t> out(static_cast<size_t>(tg)), ctx(static_cast<size_t>(depth));
    for (auto& i : ctx) i = tok(rng);
    for (int r = 0; r < reps + 1; ++r) {  // the first run captures the graph and warms up
      auto st = cm->new_state(opt.kv);
      if (depth > 0) cm->forward(*st, ctx.data(), depth, LogitsMode::None, nullptr);  // the context, not timed
      if (r == 1) cm->reset_tier_stats();
      auto t = Clock::now();
      cm->decode_greedy(*st, tok(rng), tg, out.data());
      if (r > 0) rate.push_back(double(tg) / seconds_since(t));
    }
    Stat st = stats(rate);
    print_tg(tg, depth, st);
    const double bytes = double(cm->weight_bytes_per_token());
    const double gbps = st.mean * bytes / 1e9;
    const double copy = cuda_copy_bandwidth_gbps(*cm);
    std::printf("decode reads %.1f MB of weights per token -> %.1f GB/s; device copy (cudaMemcpy D2D, read+written): "
                "%.1f GB/s; decode at %.0f%% of that roofline (roofline %.1f tokens/s)\n",
                bytes / 1e6, gbps, copy, 100.0 * gbps / copy, copy * 1e9 / bytes);
    const CudaTierStats ts = cm->tier_stats();
    if (ts.enabled) {
      // Experts read over the host link per token, and the speed that link
      // alone would allow (the VRAM part runs at the roofline above).
      const double tokens = double(tg) * reps;
      const double host_bytes = double(ts.host_hits) * double(ts.expert_bytes) / tokens;
      const double link = cuda_host_link_gbps(*cm);
      const double t_link = host_bytes / (link * 1e9), t_vram = (bytes - host_bytes) / (copy * 1e9);
      std::printf("%s\n", format_tier_stats(ts, int64_t(tokens)).c_str());
      std::printf("host->device link (cudaMemcpy from pinned memory): %.1f GB/s; link-bound decode %.1f tokens/s "
                  "(link + VRAM roofline: %.1f tokens/s); tg at %.0f%% of the link bound\n",
                  link, host_bytes > 0 ? 1.0 / t_link : 0.0, 1.0 / (t_link + t_vram),
                  host_bytes > 0 ? 100.0 * st.mean * t_link : 0.0);
    }
  }
  if (profile_steps > 0) {
    auto st = cm->new_state(opt.kv);
    std::vector<int32_t> out(64);
    cm->decode_greedy(*st, tok(rng), 64, out.data());  // some context first
    auto times = cuda_profile_decode(*cm, *st, out.back(), profile_steps);
    double total = 0;
    for (auto& k : times) total += k.ms;
    std::printf("per-kernel time of a decode step (plain launches, cudaEvents between kernels, %d steps at context 64+):\n",
                profile_steps);
    std::printf("| kernel class | ms/token | launches/token | share |\n|---|---|---|---|\n");
    for (auto& k : times)
      if (k.launches > 0)
        std::printf("| %s | %.4f | %d | %.1f%% |\n", k.name.c_str(), k.ms / profile_steps, k.launches / profile_steps,
                    100.0 * k.ms / total);
    std::printf("| total | %.4f | | |\n", total / profile_steps);
  }
}

Registrar reg(40, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Measure prompt processing (pp) and generation (tg) speed");
  auto opt = std::make_shared<ModelOptions>();
  auto pp = std::make_shared<int>(512);
  auto tg = std::make_shared<int>(128);
  auto depth = std::make_shared<int>(0);
  auto reps = std::make_shared<int>(3);
  auto synthetic = std::make_shared<std::string>();
  auto layers = std::make_shared<int>(0);
  auto no_graph = std::make_shared<bool>(false);
  auto profile = std::make_shared<int>(0);
  auto experts = std::make_shared<std::string>("bf16");
  auto group = std::make_shared<int>(64);
  add_model_options(cmd, opt.get(), /*require_model=*/false);
  cmd->add_option("-p,--n-prompt", *pp, "Prompt tokens for the pp test (0: skip)")->check(CLI::Range(0, 1000000));
  cmd->add_option("-n,--n-gen", *tg, "Generated tokens for the tg test (0: skip)")->check(CLI::Range(0, 1000000));
  cmd->add_option("-d,--depth", *depth,
                  "Context tokens (random, prefilled before each tg run and not timed): tg at that depth")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("-r,--repetitions", *reps, "Repetitions of each test")->check(CLI::Range(1, 1000));
  cmd->add_option("--synthetic", *synthetic,
                  "On the GPU (--device cuda or auto): random bf16 weights of a published size instead of -m (qwen3.5-35b-a3b, "
                  "qwen3.5-122b-a10b, qwen3.5-397b-a17b, qwen3-next-80b-a3b)");
  cmd->add_option("--layers", *layers, "With --synthetic: only the first N layers")->check(CLI::NonNegativeNumber);
  auto* ex = cmd->add_option("--experts", *experts,
                              "With --synthetic: the routed experts' format, bf16 (default), q8 or q4 (as flashmoe pack "
                              "writes them)");
  auto* gr = cmd->add_option("--group", *group, "With --synthetic --experts q8|q4: quantisation group size (default 64)");
  cmd->add_flag("--no-graph", *no_graph, "On the GPU: plain kernel launches instead of a CUDA graph");
  cmd->add_option("--profile", *profile, "On the GPU: time each kernel class over N decode steps")
      ->check(CLI::NonNegativeNumber);
  cmd->callback([opt, pp, tg, depth, reps, synthetic, layers, no_graph, profile, experts, group, ex, gr] {
    finalize_model_options(opt.get());
    if (opt->model_dir.empty() == synthetic->empty())
      fail(synthetic->empty() ? "bench: give a model with -m/--model (or --synthetic on a GPU)"
                              : "bench: give either -m/--model or --synthetic, not both");
    if (!synthetic->empty()) {
      std::string what;
      auto cm = synthetic_model(*opt, *synthetic, *layers, *experts, *group, &what);
      bench_cuda(*opt, cm.get(), what, *pp, *tg, *depth, *reps, *no_graph, *profile);
      return;
    }
    if (ex->count() || gr->count())
      fail("bench: --experts and --group are for --synthetic (a model's experts are in the format it was packed in)");
    LoadedModel lm = load_model(*opt);
    if (lm.cuda) {
      bench_cuda(*opt, lm.cuda.get(), opt->model_dir, *pp, *tg, *depth, *reps, *no_graph, *profile);
      return;
    }
    auto& model = lm.host;
    ThreadPool pool(opt->threads);
    const int PP = *pp, TG = *tg, D = *depth, REPS = *reps;
    const ModelConfig& c = model->config();
    WeightBytes wb = count_weight_bytes(c, model->weights());
    std::mt19937 rng(1234);
    std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size - 1));
    std::printf("model: %s (%s, %lld layers, %.1f MB of weights)\nthreads: %d\n", opt->model_dir.c_str(),
                c.model_type.c_str(), (long long)c.num_layers, double(wb.total) / 1e6, pool.size());
    std::printf("| test  | tokens/s (mean ± sd) |\n|-------|----------------------|\n");
    if (PP > 0) {
      std::vector<double> rate;
      std::vector<int32_t> ids(static_cast<size_t>(PP));
      for (auto& i : ids) i = tok(rng);
      Session warm(*model, opt->kv, pool);
      warm.feed(std::vector<int32_t>(ids.begin(), ids.begin() + std::min<size_t>(ids.size(), 16)));
      for (int r = 0; r < REPS; ++r) {
        Session s(*model, opt->kv, pool);
        auto t = Clock::now();
        s.feed(ids);
        rate.push_back(double(PP) / seconds_since(t));
      }
      Stat st = stats(rate);
      std::printf("| pp%-3d | %9.1f ± %-8.1f |\n", PP, st.mean, st.sd);
    }
    if (TG > 0) {
      std::vector<double> rate;
      std::vector<int32_t> ctx(static_cast<size_t>(D));
      for (auto& i : ctx) i = tok(rng);
      for (int r = 0; r < REPS + 1; ++r) {  // first run warms caches and pages
        Session s(*model, opt->kv, pool);
        if (D > 0) s.feed(ctx);  // the context, not timed
        int32_t next = tok(rng);
        auto t = Clock::now();
        for (int i = 0; i < TG; ++i) next = argmax(s.feed({next}).data(), c.vocab_size);
        if (r > 0) rate.push_back(double(TG) / seconds_since(t));
      }
      Stat st = stats(rate);
      print_tg(TG, D, st);
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
