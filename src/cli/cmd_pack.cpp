// flashmoe pack: rewrite an HF checkpoint into the expert-streaming layout.
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <functional>

#include "cli/command.h"
#include "cli/validators.h"
#include "format/model_files.h"
#include "core/error.h"
#include "experts/expert_layout.h"
#include "kv/presets.h"
#include "model/pack_model.h"
#include "model/synthetic_pack.h"

namespace flashmoe::cli {
namespace {

// SIGINT / SIGTERM during a pack: the handler only records the signal; the
// pack stops at its next expert and removes its temporary directory, then
// the signal is raised again with its default action, so the exit status
// says what ended the process (a shell sees 130 / 143, as without us).
volatile std::sig_atomic_t g_pack_signal = 0;
void on_pack_signal(int sig) { g_pack_signal = sig; }

void catch_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_pack_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM}) ::sigaction(sig, &sa, nullptr);
  // Unblocked too: a signal sent while the parent had it blocked is pending
  // from the start and is seen at the pack's first check.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
}

Registrar reg_pack(19, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("pack", "Pack an HF checkpoint for expert streaming (per-layer expert files + manifest)");
  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto format = std::make_shared<std::string>("bf16");
  auto group = std::make_shared<int>(64);
  auto synthetic = std::make_shared<std::string>();
  auto layers = std::make_shared<int>(0);
  cmd->add_option("-m,--model", *in, "HF model directory (config.json + safetensors)");
  cmd->add_option("--synthetic", *synthetic,
                  "Instead of -m: write a packed model of a published Qwen3.5 size with random weights (qwen3.5-35b-a3b, "
                  "qwen3.5-122b-a10b, qwen3.5-397b-a17b), one expert record at a time, to measure streaming at its "
                  "record size; prints the bytes it will write first");
  auto* ly = cmd->add_option("--layers", *layers, "With --synthetic: only the first N layers (0: all)")
                 ->check(integer_between(0, 2147483647));
  cmd->add_option("-o,--output", *out, "Output directory (must not exist)")->required();
  cmd->add_option("--experts", *format, "Expert format: bf16 (default), q8, q4 (group-wise affine, MLX layout), fp8 (an FP8 checkpoint's experts as stored)");
  cmd->add_option("--group", *group, "Quantisation group size along the input dimension (default 64)")
      ->check(integer_between(1, 2147483647));
  cmd->callback([=] {
    PackOptions opt;
    opt.experts = parse_expert_format(*format, "--experts");
    opt.group = *group;
    const bool tty = ::isatty(2);
    auto show_progress = [&](int64_t done, int64_t total) {
      const int width = 30, filled = int(width * done / total);
      std::fprintf(stderr, "%spacking experts [%.*s%*s] %lld/%lld layers%s", tty ? "\r" : "", filled,
                   "##############################", width - filled, "", (long long)done, (long long)total,
                   tty && done < total ? "" : "\n");
      std::fflush(stderr);
    };
    // A pack stopped by SIGINT / SIGTERM ends by that signal (see catch_stop_signals).
    auto run_pack = [&](const std::function<void()>& pack) {
      opt.stop = &g_pack_signal;
      catch_stop_signals();
      try {
        pack();
      } catch (const Error& e) {
        if (const int sig = g_pack_signal) {
          std::fprintf(stderr, "%sflashmoe: error: %s\n", tty ? "\n" : "", e.what());
          std::fflush(stderr);
          std::signal(sig, SIG_DFL);
          std::raise(sig);
        }
        throw;
      }
    };
    if (in->empty() == synthetic->empty())
      fail(in->empty() ? "pack: give a model with -m/--model, or --synthetic PRESET"
                       : "pack: give either -m/--model or --synthetic, not both");
    if (!synthetic->empty()) {
      ModelConfig c = model_preset(*synthetic);
      if (c.family != Family::Qwen35) fail("pack --synthetic: " + *synthetic + " is not a Qwen3.5 size (pick a qwen3.5-* preset)");
      if (*layers > c.num_layers)
        fail("pack: --layers " + std::to_string(*layers) + " is more than " + *synthetic + "'s " +
             std::to_string(c.num_layers) + " layers");
      if (*layers > 0) {
        c.num_layers = *layers;
        c.layer_kinds.resize(size_t(*layers));
        c.layer_is_moe.resize(size_t(*layers));
      }
      std::fprintf(stderr, "pack --synthetic %s: %d layers, experts %s, %.2f GiB to write\n", synthetic->c_str(),
                   int(c.num_layers), format->c_str(), double(synthetic_pack_bytes(c, opt)) / double(1ull << 30));
      run_pack([&] { pack_synthetic(c, *out, opt, show_progress); });
      std::fprintf(stderr, "packed synthetic %s -> %s (experts %s)\n", synthetic->c_str(), out->c_str(), format->c_str());
      return;
    }
    if (ly->count()) fail("pack: --layers is for --synthetic (a checkpoint is packed whole)");
    const ModelFiles files = resolve_model_files(*in);
    if (!files.gguf.empty())
      fail(*in + ": flashmoe pack does not read GGUF files yet (run the GGUF directly: -m " + *in + ")");
    for (const std::string* f : {&files.tokenizer_json, &files.tokenizer_config})
      if (!f->empty()) opt.extra_files.push_back(*f);
    run_pack([&] { pack_model(files.model_dir, *out, opt, show_progress); });
    std::fprintf(stderr, "packed %s -> %s (experts %s)\n", in->c_str(), out->c_str(), format->c_str());
  });
});

}  // namespace
}  // namespace flashmoe::cli
