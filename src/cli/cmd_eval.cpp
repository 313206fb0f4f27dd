// flashmoe eval: what a KV-cache configuration costs in quality — perplexity
// and mean KL against the f32 full cache on held-out text, and greedy recall
// of values defined N tokens earlier (see docs/kv-quality.md).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/validators.h"
#include "cli/common.h"
#include "core/error.h"
#include "engine/eval.h"
#include "format/model_files.h"
#include "tokenizer/gguf_tokenizer.h"

namespace flashmoe::cli {
namespace {

struct EvalArgs {
  std::string perplexity, recall;
  int64_t window_tokens = 2048;
  int64_t max_windows = 0;
  int64_t score_from = 0;
  bool json = false;
  bool quiet = false;
};

void run_eval(ModelOptions& mo, const EvalArgs& a) {
  finalize_model_options(&mo);
  if (a.perplexity.empty() && a.recall.empty()) fail("eval: give --perplexity FILE and/or --recall FILE.jsonl");
  const ModelFiles paths = resolve_model_files(mo.model_dir);
  if (paths.tokenizer_json.empty() && paths.gguf.empty())
    fail("tokenizer.json not found for " + mo.model_dir + " (looked in the model directory and next to it)");
  const Tokenizer tok = load_tokenizer(paths.gguf.empty() ? paths.tokenizer_json : paths.gguf);
  // Read and check the inputs before the (slower) model load.
  std::vector<int32_t> text_ids;
  if (!a.perplexity.empty()) text_ids = tokenize_file(tok, a.perplexity);
  std::vector<RecallItem> items;
  if (!a.recall.empty()) items = load_recall_jsonl(a.recall);

  std::unique_ptr<Backend> backend = load_model(mo);
  // With --moe-top-k the KL reference is the unmodified model: a second copy
  // loaded at its own top-k (the routing is fixed at load).
  std::unique_ptr<Backend> reference;
  if (mo.experts.experts_per_token > 0 && !a.perplexity.empty()) {
    ModelOptions own = mo;
    own.experts.experts_per_token = 0;
    reference = load_model(own);
  }
  ThreadPool pool(mo.threads);
  const bool tty = !a.quiet;
  EvalProgress progress;
  if (tty)
    progress = [erase = isatty(2) != 0](const std::string& s) {
      std::fprintf(stderr, "\r%s%s", s.c_str(), erase ? "\033[K" : "   ");
      std::fflush(stderr);
    };

  nlohmann::ordered_json out;
  // Which backend produced the numbers: they agree to rounding (fp32 math on
  // both), and the decode speed is the device's.
  const std::string device = backend->label();
  out["device"] = backend->kind();
  out["kv"] = mo.kv.describe();
  const int64_t top_k = backend->config().num_experts_per_tok;
  out["experts_per_token"] = top_k;
  std::string text;
  text += "model: " + paths.model_dir + "\ndevice: " + device + "\nkv: " + mo.kv.describe() + "\n";
  if (reference)
    text += "experts per token: " + std::to_string(top_k) + " (--moe-top-k; the model's own: " +
            std::to_string(reference->config().num_experts_per_tok) + ")\n";
  size_t kv_bytes = 0;
  char buf[256];
  if (!a.perplexity.empty()) {
    PerplexityOptions po;
    po.window_tokens = a.window_tokens;
    po.max_windows = a.max_windows;
    po.reference = reference.get();
    po.score_from = a.score_from;
    const PerplexityResult r = eval_perplexity(*backend, text_ids, mo.kv, pool, po, progress);
    if (tty) std::fprintf(stderr, "\n");
    out["perplexity"] = r.perplexity;
    out["mean_kl"] = r.mean_kl;
    out["windows"] = r.windows;
    out["window_tokens"] = a.window_tokens;
    out["scored"] = r.scored;
    kv_bytes = std::max(kv_bytes, r.kv_bytes);
    std::snprintf(buf, sizeof buf, "perplexity: %.4f over %lld windows of %lld tokens (%lld positions)\n",
                  r.perplexity, (long long)r.windows, (long long)a.window_tokens, (long long)r.scored);
    text += buf;
    std::snprintf(buf, sizeof buf, "mean KL vs f32 full%s: %.6g%s\n",
                  reference ? " at the model's own top-k" : "", r.mean_kl,
                  is_reference_kv(mo.kv) && !reference ? " (this is the reference)" : "");
    text += buf;
  }
  if (!items.empty()) {
    const RecallResult r = eval_recall(*backend, tok, items, mo.kv, pool, progress);
    if (tty) std::fprintf(stderr, "\n");
    nlohmann::ordered_json rec = nlohmann::ordered_json::object();
    std::snprintf(buf, sizeof buf, "recall: %lld/%lld\n", (long long)r.correct, (long long)r.total);
    text += buf;
    for (const auto& [filler, c] : r.by_filler) {
      rec[std::to_string(filler)] = {{"correct", c.correct}, {"total", c.total}};
      std::snprintf(buf, sizeof buf, "  filler %5lld: %lld/%lld\n", (long long)filler, (long long)c.correct,
                    (long long)c.total);
      text += buf;
    }
    out["recall"] = rec;
    out["decode_tokens_per_s"] = r.decode_tokens_per_s();
    kv_bytes = std::max(kv_bytes, r.kv_bytes);
    std::snprintf(buf, sizeof buf, "decode: %.1f tokens/s (%lld single-token steps after the recall prompts)\n",
                  r.decode_tokens_per_s(), (long long)r.decode_tokens);
    text += buf;
  }
  out["kv_bytes"] = kv_bytes;
  std::snprintf(buf, sizeof buf,
                "kv bytes at the end of the longest sequence: %zu (retained positions x bytes per position, as "
                "kv-calc counts them)\n",
                kv_bytes);
  text += buf;
  if (a.json)
    std::printf("%s\n", out.dump().c_str());
  else
    std::fputs(text.c_str(), stdout);
}

Registrar reg_eval(35, [](CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "eval",
      "Measure a KV-cache configuration's quality: perplexity, mean KL vs the f32 full cache, recall.\n"
      "With --moe-top-k K: the KL reference is the model at its own top-k (loaded a second time).\n"
      "-m accepts the model directory (config.json + safetensors; tokenizer.json there or one level up)\n"
      "or the directory above a model/ subdirectory (e.g. -m models/coder-mini or -m models/coder-mini/model)");
  auto mo = std::make_shared<ModelOptions>();
  auto a = std::make_shared<EvalArgs>();
  add_model_options(cmd, mo.get());
  cmd->add_option("--perplexity", a->perplexity,
                  "Text file: perplexity over consecutive windows (each from a fresh session) and mean KL vs f32 full");
  cmd->add_option("--recall", a->recall,
                  "JSONL of {prompt, answer, filler_tokens}: greedy continuation must start with answer");
  cmd->add_option("--window-tokens", a->window_tokens, "Tokens per perplexity window (a partial last window is dropped)")
      ->capture_default_str()
      ->check(integer_between(2, int64_t(1) << 40));
  cmd->add_option("--max-windows", a->max_windows, "Evaluate at most this many windows (0: all)")
      ->capture_default_str()
      ->check(integer_at_least(0));
  cmd->add_option("--score-from", a->score_from,
                  "Feed each window's first N tokens as a prompt and the rest one token at a time (decoding), and score "
                  "only the predictions from position N on (llama-perplexity's KL mode scores the second half: 1024 of "
                  "2048; --kv-snapkv compresses the prompt there)")
      ->capture_default_str()
      ->check(integer_at_least(0));
  cmd->add_flag("--json", a->json, "Print one JSON object on stdout instead of the text summary");
  cmd->add_flag("-q,--quiet", a->quiet, "No progress on stderr");
  // Every option's storage is captured explicitly (see cmd_generate.cpp).
  cmd->callback([mo, a] { run_eval(*mo, *a); });
});

}  // namespace
}  // namespace flashmoe::cli
