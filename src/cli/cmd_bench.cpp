// flashmoe bench: llama-bench style prompt-processing (pp) and token-
// generation (tg) speed, plus what decode achieves of the memory bandwidth.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "cli/command.h"
#include "cli/validators.h"
#include "cli/common.h"
#include "core/argmax.h"
#include "core/error.h"
#include "engine/session.h"
#include "engine/speculative.h"
#include "experts/expert_layout.h"
#include "cli/generation_options.h"
#include "cli/synthetic_options.h"
#include "kv/presets.h"
#include "model/weight_bytes.h"
#include "runtime/bench_support.h"

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

// "| tg128 |" or, at a context depth, "| tg128 @ d4096 |" (llama-bench's naming).
void print_tg(int tg, int depth, const Stat& st) {
  if (depth > 0) std::printf("| tg%d @ d%d | %9.1f ± %-8.1f |\n", tg, depth, st.mean, st.sd);
  else std::printf("| tg%-3d | %9.1f ± %-8.1f |\n", tg, st.mean, st.sd);
}

void run_batch_tg(const ModelOptions& opt, const Backend& b, int tg, int depth, int reps, int batch);

// bench --mtp: the tg test decoded with speculative decoding, beside plain decoding.
// Every draft length with every acceptance is one speculative run per
// repetition, beside the same plain run.
struct MtpBench {
  std::vector<int> drafts;     // tokens drafted per pass (empty: no --mtp)
  std::vector<double> accept;  // --mtp-accept: forced acceptance per drafted token (empty: the model decides)
  bool refeed = false;         // --mtp-refeed: each run also with the roll-back by restore + re-feed
};
void run_mtp_tg(const ModelOptions& opt, const Backend& b, int tg, int depth, int reps, const MtpBench& mtp);

// The tg test of one sequence: generation through Backend::greedy (on a
// GPU: CUDA-graph replays, no host round trip per token), then what decode
// achieves of the weight memory's bandwidth.
void run_single_tg(const ModelOptions& opt, const Backend& b, int tg, int depth, int reps,
                   const std::vector<std::string>& host_copies,
                   std::mt19937& rng, ThreadPool& pool) {
  const ModelConfig& c = b.config();
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size - 1));
  // Without --host-copies one run as the model was built; with it one per
  // value, on the same model, side by side.
  const std::vector<std::string> variants = host_copies.empty() ? std::vector<std::string>{""} : host_copies;
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    if (!variants[vi].empty()) {
      // off | N | Na (--host-copies below)
      const std::string& v = variants[vi];
      const bool on = v != "off";
      const int n = on ? v[0] - '0' : 0;
      const bool next = on && v.size() == 1;
      if (!set_host_copies(b, on, n, next))
        fail("bench --host-copies: the model has no host tier of q4/q8 experts (a GPU, q4/q8 experts and "
             "--gpu-expert-cache below what they need)");
      if (!on)
        std::printf("host-tier experts: zero-copy expert kernels (the decode graph)\n");
      else
        std::printf("host-tier experts: copy engine, %d copied ahead per MoE layer (%s)\n", n,
                    next ? "predicted at the previous MoE layer's router" : "predicted from the layer's input");
    }
    std::vector<double> rate;
    std::vector<int32_t> out(static_cast<size_t>(tg)), ctx(static_cast<size_t>(depth));
    for (auto& i : ctx) i = tok(rng);
    for (int r = 0; r < reps + 1; ++r) {  // the first run warms up (caches, pages, the graph capture)
      auto st = b.new_state(opt.kv);
      if (depth > 0) b.forward(*st, ctx.data(), depth, LogitsMode::None, nullptr, pool);  // the context, not timed
      if (r == 1) b.reset_expert_stats();
      auto t = Clock::now();
      b.greedy(*st, tok(rng), tg, out.data(), pool);
      if (r > 0) rate.push_back(double(tg) / seconds_since(t));
    }
    Stat st = stats(rate);
    print_tg(tg, depth, st);
    const double bytes = double(b.weight_bytes_per_token());
    const double gbps = st.mean * bytes / 1e9;
    const Bandwidth copy = weight_memory_bandwidth(b, pool);
    std::printf("decode reads %.2f MB of weights per token -> %.2f GB/s; %s: %.1f GB/s; decode at %.0f%% of that "
                "roofline (roofline %.1f tokens/s)\n",
                bytes / 1e6, gbps, copy.what.c_str(), copy.gbps, 100.0 * gbps / copy.gbps, copy.gbps * 1e9 / bytes);
    const ExpertTierStats ts = b.tier_stats();
    if (ts.enabled) {
      // Experts read over the host link per token, and the speed that link
      // alone would allow (the VRAM part runs at the roofline above).
      const double tokens = double(tg) * reps;
      const double host_bytes = double(ts.host_hits) * double(ts.expert_bytes) / tokens;
      const double link = host_link_gbps(b);
      const double t_link = host_bytes / (link * 1e9), t_vram = (bytes - host_bytes) / (copy.gbps * 1e9);
      std::printf("%s\n", b.expert_stats(int64_t(tokens)).c_str());
      std::printf("host->device link (cudaMemcpy from pinned memory): %.1f GB/s; link-bound decode %.1f tokens/s "
                  "(link + VRAM roofline: %.1f tokens/s); tg at %.0f%% of the link bound\n",
                  link, host_bytes > 0 ? 1.0 / t_link : 0.0, 1.0 / (t_link + t_vram),
                  host_bytes > 0 ? 100.0 * st.mean * t_link : 0.0);
      if (vi == 0) {
        const std::string rates = host_link_rates(b);
        if (!rates.empty()) std::printf("host link rates: %s\n", rates.c_str());
      }
    }
  }
}

// Prompt processing through one forward pass per repetition, then the tg
// test once per --batch value.
void run_bench(const ModelOptions& opt, const Backend& b, const std::string& what, int pp, int tg, int depth,
               int reps, bool no_graph, int profile_steps, const std::vector<int>& batches,
               const std::vector<std::string>& host_copies,
               const MtpBench& mtp) {
  ThreadPool pool(opt.threads);
  set_decode_graph(b, !no_graph);
  const ModelConfig& c = b.config();
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size - 1));
  std::printf("model: %s (%s, %lld layers, %.2f GB of weights on %s)\nkv: %s; threads: %d%s\n", what.c_str(),
              c.model_type.c_str(), (long long)c.num_layers, double(b.weight_bytes_total()) / 1e9,
              b.label().c_str(), opt.kv.describe().c_str(), pool.size(),
              has_decode_graph(b) ? (no_graph ? "; cuda graph: off" : "; cuda graph: on") : "");
  std::printf("| test  | tokens/s (mean ± sd) |\n|-------|----------------------|\n");
  std::vector<float> logits(size_t(c.vocab_size));
  if (pp > 0) {
    std::vector<double> rate;
    std::vector<int32_t> ids(static_cast<size_t>(pp));
    for (auto& i : ids) i = tok(rng);
    {
      auto warm = b.new_state(opt.kv);
      b.forward(*warm, ids.data(), std::min<int64_t>(pp, 16), LogitsMode::Last, logits.data(), pool);
    }
    for (int r = 0; r < reps; ++r) {
      auto st = b.new_state(opt.kv);
      auto t = Clock::now();
      b.forward(*st, ids.data(), pp, LogitsMode::Last, logits.data(), pool);
      rate.push_back(double(pp) / seconds_since(t));
    }
    Stat st = stats(rate);
    std::printf("| pp%-3d | %9.1f ± %-8.1f |\n", pp, st.mean, st.sd);
  }
  if (tg > 0 && !mtp.drafts.empty()) {
    run_mtp_tg(opt, b, tg, depth, reps, mtp);
  } else if (tg > 0) {
    // Each --batch value on the same model, in the order given.
    for (int batch : batches) {
      if (batch > 1) run_batch_tg(opt, b, tg, depth, reps, batch);
      else run_single_tg(opt, b, tg, depth, reps, host_copies, rng, pool);
    }
  }
  if (profile_steps > 0) {
    auto st = b.new_state(opt.kv);
    std::vector<int32_t> out(64);
    b.greedy(*st, tok(rng), 64, out.data(), pool);  // some context first
    auto times = profile_decode(b, *st, out.back(), profile_steps);
    if (times.empty()) return;  // no kernels to time (the CPU)
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

// `bench --mtp`: per repetition, plain greedy decoding (Backend::greedy, as
// the tg test) and then speculative decoding (greedy_speculative on a
// drafting state) of tg tokens each from the same first token and context,
// once per draft length and forced acceptance; the ratios are taken per
// repetition (side by side), the first repetition warms up. Both time the
// feed of the first token and tg - 1 more.
void run_mtp_tg(const ModelOptions& opt, const Backend& b, int tg, int depth, int reps, const MtpBench& mtp) {
  ThreadPool pool(opt.threads);
  const ModelConfig& c = b.config();
  std::mt19937 rng(4321);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size - 1));
  struct Run {
    int draft;
    double accept;  // < 0: the model decides
    bool take_back;
    std::vector<double> rate, ratio;
    SpecStats total;
  };
  std::vector<Run> runs;
  const std::vector<double> accepts = mtp.accept.empty() ? std::vector<double>{-1} : mtp.accept;
  for (int n : mtp.drafts)
    for (double a : accepts)
      for (bool tb : {true, false})
        if (tb || mtp.refeed) runs.push_back({n, a, tb, {}, {}, {}});
  std::vector<double> plain;
  std::vector<int32_t> out(static_cast<size_t>(tg)), ctx(static_cast<size_t>(depth));
  for (int r = 0; r < reps + 1; ++r) {
    for (auto& i : ctx) i = tok(rng);
    const int32_t first = tok(rng);
    double p = 0;
    {
      auto st = b.new_state(opt.kv);
      if (depth > 0) b.forward(*st, ctx.data(), depth, LogitsMode::None, nullptr, pool);
      auto t = Clock::now();
      b.greedy(*st, first, tg, out.data(), pool);
      p = double(tg) / seconds_since(t);
    }
    if (r > 0) plain.push_back(p);
    for (Run& run : runs) {
      Session s(b, opt.kv, pool, /*drafting=*/true);
      s.set_record_tokens(false);
      if (depth > 0) s.feed(ctx);
      SpecStats st;
      auto t = Clock::now();
      const std::vector<float>& l = s.feed({first});
      greedy_speculative(s, l, tg, run.draft, &st, run.accept, uint64_t(r) + 1, run.take_back);
      const double q = double(tg) / seconds_since(t);
      if (r == 0) continue;
      run.total.add(st);
      run.rate.push_back(q);
      run.ratio.push_back(q / p);
    }
  }
  const Stat a = stats(plain);
  const std::string at = depth > 0 ? " @ d" + std::to_string(depth) : "";
  std::printf("| tg%d%s plain | %9.1f ± %-8.1f |\n", tg, at.c_str(), a.mean, a.sd);
  for (const Run& run : runs) {
    char label[128];
    const char* how = run.take_back ? "" : ", re-fed";
    if (run.accept >= 0)
      std::snprintf(label, sizeof label, "--mtp N=%d, forced acceptance %.2f%s", run.draft, run.accept, how);
    else std::snprintf(label, sizeof label, "--mtp N=%d%s", run.draft, how);
    const Stat m = stats(run.rate), x = stats(run.ratio);
    std::printf("| tg%d%s %s | %9.1f ± %-8.1f |\n", tg, at.c_str(), label, m.mean, m.sd);
    std::printf("%s\n%s: speculative / plain %.3fx ± %.3f (per repetition, side by side)\n",
                run.total.describe().c_str(), label, x.mean, x.sd);
  }
}

// `bench --batch B`: B independent sequences decoding together, one
// Backend::forward_batch per step (each sequence's own state, own first
// token, greedy), against the bytes such a step must read: the weights
// outside the routed experts once, plus every expert the B tokens picked
// (the union per layer: counted by the expert store where it sees the
// fetches, else the uniform-routing expectation E * (1 - (1 - k/E)^B)).
void run_batch_tg(const ModelOptions& opt, const Backend& b, int tg, int depth, int reps, int batch) {
  ThreadPool pool(opt.threads);
  const ModelConfig& c = b.config();
  const int64_t V = c.vocab_size;
  std::mt19937 rng(4321);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(V - 1));
  // A model built on the GPU (synthetic) has no host model: no store counts,
  // and the expert size comes from the tiers or the config (bf16).
  const QwenModel* host = nullptr;
  try {
    host = &b.model();
  } catch (const Error&) {
  }
  auto requested = [&] { return host ? host->expert_store().stats().requested : uint64_t(0); };
  std::vector<double> agg;
  double unions = 0, steps_seen = 0;
  for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
    std::vector<std::unique_ptr<State>> st;
    std::vector<int32_t> next(static_cast<size_t>(batch)), ctx(static_cast<size_t>(depth));
    for (int i = 0; i < batch; ++i) {
      st.push_back(b.new_state(opt.kv));
      for (auto& t : ctx) t = tok(rng);
      if (depth > 0) b.forward(*st.back(), ctx.data(), depth, LogitsMode::None, nullptr, pool);
      next[size_t(i)] = tok(rng);
    }
    // Greedy: each sequence's argmax written over its next token (picked on
    // the device where the backend keeps the logits there).
    std::vector<BatchItem> items(static_cast<size_t>(batch));
    for (int i = 0; i < batch; ++i)
      items[size_t(i)] = {st[size_t(i)].get(), &next[size_t(i)], 1, LogitsMode::Last, nullptr, &next[size_t(i)]};
    const uint64_t req0 = requested();
    auto t = Clock::now();
    for (int s = 0; s < tg; ++s) b.forward_batch(items.data(), batch, pool);
    const double sec = seconds_since(t);
    if (r == 0) continue;
    agg.push_back(double(batch) * tg / sec);
    unions += double(requested() - req0);
    steps_seen += tg;
  }
  const Stat a = stats(agg);
  std::printf("| tg%d x%d (aggregate) | %9.1f ± %-8.1f |\n| tg%d x%d (per sequence) | %9.1f ± %-8.1f |\n", tg, batch,
              a.mean, a.sd, tg, batch, a.mean / batch, a.sd / batch);

  int64_t moe_layers = 0;
  for (bool m : c.layer_is_moe) moe_layers += m ? 1 : 0;
  const double E = double(c.num_experts), k = double(c.num_experts_per_tok);
  double expert = 0;
  if (host && moe_layers > 0)
    expert = double(count_weight_bytes(c, host->weights()).experts_total) / (E * double(moe_layers));
  else if (b.tier_stats().expert_bytes > 0)
    expert = double(b.tier_stats().expert_bytes);
  else
    expert = 3.0 * double(c.hidden_size) * double(c.moe_intermediate) * 2.0;  // gate, up, down in bf16
  const double shared = double(b.weight_bytes_per_token()) - k * double(moe_layers) * expert;
  const bool counted = unions > 0;
  const double per_layer = counted ? unions / steps_seen / double(std::max<int64_t>(moe_layers, 1))
                                   : E * (1.0 - std::pow(1.0 - k / E, double(batch)));
  const double step_bytes = shared + per_layer * double(moe_layers) * expert;
  const Bandwidth bw = weight_memory_bandwidth(b, pool);
  const double roof = double(batch) * bw.gbps * 1e9 / step_bytes;
  std::printf("step bytes = non-expert weights %.2f MB + %.1f experts per MoE layer (%s, of %d) x %lld layers x "
              "%.2f MB = %.2f MB;\n%s: %.1f GB/s -> roofline %d x %.1f / %.4f GB = %.1f tokens/s; reached %.0f%%\n",
              shared / 1e6, per_layer, counted ? "counted" : "expected, uniform routing", int(E),
              (long long)moe_layers, expert / 1e6, step_bytes / 1e6, bw.what.c_str(), bw.gbps, batch, bw.gbps,
              step_bytes / 1e9, roof, 100.0 * a.mean / roof);
}

// `bench --bandwidth`: the host's DRAM read bandwidth on its own, over
// buffers several times the last-level cache (the roofline a memory-bound
// CPU decode is measured against).
void run_bandwidth(int threads) {
  ThreadPool pool(threads);
  const int64_t llc = last_level_cache_bytes();
  const int64_t bytes = std::max<int64_t>(4 * llc, int64_t(256) << 20);
  std::printf("last-level cache: %s\n", llc > 0 ? (std::to_string(llc >> 20) + " MiB").c_str() : "unknown");
  const Bandwidth bw = dram_read_bandwidth(pool, bytes);
  std::printf("%s: %.1f GB/s\n", bw.what.c_str(), bw.gbps);
}

Registrar reg_bench(40, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Measure prompt processing (pp) and generation (tg) speed");
  auto opt = std::make_shared<ModelOptions>();
  auto pp = std::make_shared<int>(512);
  auto tg = std::make_shared<int>(128);
  auto depth = std::make_shared<int>(0);
  auto reps = std::make_shared<int>(3);
  auto synthetic = std::make_shared<SyntheticOptions>();
  auto no_graph = std::make_shared<bool>(false);
  auto profile = std::make_shared<int>(0);
  auto bandwidth = std::make_shared<bool>(false);
  auto batch = std::make_shared<std::vector<int>>(std::vector<int>{1});
  auto host_copies = std::make_shared<std::vector<std::string>>();
  auto mtp = std::make_shared<bool>(false);
  auto draft = std::make_shared<std::optional<int>>();
  auto accept = std::make_shared<std::vector<double>>();
  auto drafts = std::make_shared<std::vector<int>>();
  auto refeed = std::make_shared<bool>(false);
  add_model_options(cmd, opt.get(), /*require_model=*/false);
  cmd->add_option("-p,--n-prompt", *pp, "Prompt tokens for the pp test (0: skip)")->check(integer_between(0, 1000000));
  cmd->add_option("-n,--n-gen", *tg, "Generated tokens for the tg test (0: skip)")->check(integer_between(0, 1000000));
  cmd->add_option("-d,--depth", *depth,
                  "Context tokens (random, prefilled before each tg run and not timed): tg at that depth")
      ->check(integer_between(0, 1000000));
  cmd->add_option("-r,--repetitions", *reps, "Repetitions of each test")->check(integer_between(1, 1000));
  add_synthetic_options(cmd, synthetic.get());
  auto* bw = cmd->add_flag("--bandwidth", *bandwidth,
                           "A run of its own, instead of pp/tg: the host's DRAM read bandwidth (a read-only streaming sum "
                           "over 4 x the last-level cache, at least 256 MiB, on -t threads); no model");
  cmd->add_option("--batch", *batch,
                  "The tg test with B independent sequences decoding together (one batched forward pass per step): "
                  "aggregate and per-sequence tokens/s, and the roofline of the bytes a step reads (default 1); "
                  "comma-separated: each B in turn on the same model")
      ->delimiter(',')
      ->check(integer_between(1, 4096));
  cmd->add_option("--host-copies", *host_copies,
                  "On the GPU with a host tier of q4/q8 experts: the tg test once per value (comma-separated) on the "
                  "same model: off (the expert kernels read host-tier experts over the link, zero-copy), N (the copy "
                  "engine copies every chosen host-tier expert to VRAM, N of them (0-4) ahead of the router, "
                  "predicted at the previous MoE layer's router; the default is 2) or Na (the same, predicted from "
                  "the layer's input)")
      ->delimiter(',')
      ->check(CLI::Validator(
          [](const std::string& v) {
            const bool ok = v == "off" || ((v.size() == 1 || (v.size() == 2 && v[1] == 'a')) && v[0] >= '0' &&
                                           v[0] <= '4');
            return ok ? std::string() : "expected off, N or Na with N 0-4, got '" + v + "'";
          },
          "off|N|Na"));
  add_speculative_options(cmd, mtp.get(), draft.get());
  auto* acc = cmd->add_option("--mtp-accept", *accept,
                              "With --mtp: the verifier keeps each drafted token with this probability (0 to 1) "
                              "instead of comparing it with the model's choice, so the tg test runs at that "
                              "acceptance (for --synthetic, whose random head agrees with nothing); the tokens are "
                              "then not the model's. Several (comma-separated): one run each, side by side")
                  ->delimiter(',')
                  ->check(between(0.0, 1.0))
                  ->group("Speculative decoding");
  auto* drs = cmd->add_option("--spec-drafts", *drafts,
                              "With --mtp: several draft lengths (comma-separated) instead of --spec-draft, one run "
                              "each, side by side on the same model")
                  ->delimiter(',')
                  ->check(integer_between(1, 16))
                  ->group("Speculative decoding");
  auto* rf = cmd->add_flag("--mtp-refeed", *refeed,
                           "With --mtp: each run also rolled back the other way (restore the state from before the "
                           "verify pass, feed the kept tokens again), side by side with taking back the kept rows")
                 ->group("Speculative decoding");
  cmd->add_flag("--no-graph", *no_graph, "On the GPU: plain kernel launches instead of CUDA graphs (the decode step, and the batched steps of --batch)");
  cmd->add_option("--profile", *profile, "On the GPU: time each kernel class over N decode steps, and each phase of the batched prefill and of the batched decode steps of --batch (printed when the model is released)")
      ->check(integer_between(0, 2147483647));
  // Every option's storage is captured: the callback runs after this function returned.
  cmd->callback([opt, pp, tg, depth, reps, synthetic, no_graph, profile, bandwidth, batch, bw, host_copies,
                 mtp, draft, accept, acc, drafts, drs, refeed, rf] {
    finalize_model_options(opt.get());
    MtpBench mb;
    const int one = spec_draft_from_flags(*mtp, *draft);
    if (acc->count() && !*mtp) fail("--mtp-accept needs --mtp");
    if (drs->count() && !*mtp) fail("--spec-drafts needs --mtp");
    if (drs->count() && draft->has_value()) fail("bench: give --spec-draft or --spec-drafts, not both");
    if (*mtp) mb.drafts = drs->count() ? *drafts : std::vector<int>{one};
    mb.accept = *accept;
    if (rf->count() && !*mtp) fail("--mtp-refeed needs --mtp");
    mb.refeed = *refeed;
    const bool batched = std::any_of(batch->begin(), batch->end(), [](int b) { return b > 1; });
    if (*mtp && batched) fail("bench: --mtp and --batch are separate tests; give one of them");
    if (bw->count()) {
      if (!opt->model_dir.empty() || synthetic->given())
        fail("bench: --bandwidth is a run of its own: give it without -m/--model or --synthetic");
      run_bandwidth(opt->threads);
      return;
    }
    opt->device.gpu.prefill_profile = *profile > 0;
    if (!host_copies->empty() && batched)
      fail("bench: --host-copies is for the single-sequence tg test, not --batch");
    if (opt->model_dir.empty() && !synthetic->given())
      fail("bench: give a model with -m/--model, or --synthetic, or --bandwidth");
    check_synthetic_options("bench", *synthetic, *opt);
    // The memory plan reserves one conversation's KV cache for what the tests feed.
    opt->device.gpu.plan_context = std::max<int64_t>(2048, int64_t(*pp) + *depth + *tg + 16);
    if (synthetic->given()) {
      std::string what;
      const auto t0 = Clock::now();
      auto b = build_synthetic_model(*opt, *synthetic, *mtp, &what);
      // Building a model larger than VRAM pins its host tier: that time is part of starting it.
      if (opt->stats) {
        std::fprintf(stderr, "synthetic model built in %.1f s", seconds_since(t0));
        int64_t fr = 0, tot = 0;
        if (gpu_memory_info(&fr, &tot))
          std::fprintf(stderr, "; VRAM free after it: %.1f of %.1f GB", double(fr) / 1e9, double(tot) / 1e9);
        std::fprintf(stderr, "\n");
      }
      run_bench(*opt, *b, what, *pp, *tg, *depth, *reps, *no_graph, *profile, *batch, *host_copies, mb);
      return;
    }
    std::unique_ptr<Backend> b = load_model(*opt);
    run_bench(*opt, *b, opt->model_dir, *pp, *tg, *depth, *reps, *no_graph, *profile, *batch, *host_copies, mb);
    // The measured runs' expert reads (the counters restart after the warm-up run).
    print_expert_stats(*opt, *b, "measured runs:");
  });
});

}  // namespace
}  // namespace flashmoe::cli
