#include "cli/kv_options.h"

#include "cli/validators.h"
#include "core/error.h"

namespace flashmoe::cli {

void add_kv_options(CLI::App* cmd, KvConfig* cfg) {
  const char* group = "KV cache";
  cmd->add_option_function<std::string>(
         "--kv-dtype", [cfg](const std::string& s) { cfg->dtype = parse_kv_dtype(s); },
         "KV cache element type: f32 (default), bf16, f16, fp8 (OCP E4M3 with f32 scales)")
      ->type_name("f32|bf16|f16|fp8")
      ->group(group);
  cmd->add_option_function<std::string>(
         "--kv-fp8-scale",
         [cfg](const std::string& s) {
           cfg->fp8_scale = parse_fp8_scale_mode(s);
           cfg->fp8_scale_set = true;
         },
         "fp8 scales: one per position shared by the KV heads (default), one per position and KV head, per "
         "position and KV head after a Hadamard rotation of each head (rotated: lower error), or "
         "rotated with per-channel key offsets per page of 256 positions and least-squares scales (channel: "
         "lowest error; full cache or --kv-resident; CPU only)")
      ->type_name("position|head|rotated|channel")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-window",
         [cfg](int64_t w) {
           if (w <= 0) fail("--kv-window must be positive (got " + std::to_string(w) + ")");
           cfg->window = w;
           cfg->window_set = true;
         },
         "sliding window: keep only the last W positions (circular buffer, fixed memory)")
      ->check(integer_at_least(1))
      ->type_name("W")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-h2o",
         [cfg](int64_t b) {
           if (b <= 0) fail("--kv-h2o must be positive (got " + std::to_string(b) + ")");
           cfg->h2o_budget = b;
         },
         "heavy-hitter retention with a budget of B positions: sinks + recent + most-attended (wins over a window)")
      ->check(integer_at_least(1))
      ->type_name("B")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-tova",
         [cfg](int64_t b) {
           if (b <= 0) fail("--kv-tova must be positive (got " + std::to_string(b) + ")");
           cfg->tova_budget = b;
         },
         "TOVA retention with a budget of B positions: sinks + whatever the latest query attends to; each new "
         "token evicts the position that query attended to least (wins over a window)")
      ->check(integer_at_least(1))
      ->type_name("B")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-snapkv",
         [cfg](int64_t b) {
           if (b <= 0) fail("--kv-snapkv must be positive (got " + std::to_string(b) + ")");
           cfg->snapkv_budget = b;
         },
         "SnapKV prompt compression to B positions: the prompt is kept whole until decoding starts, then cut to "
         "the sinks, the recent share (--kv-recent, default 0.25) and the positions the prompt's last 32 queries "
         "attend to most; during decoding the recent share is a window")
      ->check(integer_at_least(1))
      ->type_name("B")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-resident",
         [cfg](int64_t n) {
           if (n <= 0) fail("--kv-resident must be positive (got " + std::to_string(n) + ")");
           cfg->resident = n;
         },
         "Quest-style retrieval: every position stays stored (in --kv-dtype; fp8 for the bounded-memory use), in "
         "pages with per-channel key bounds; each query attends over at most N positions: the first page, the "
         "newest page (the last F x N positions with --kv-recent F) and the pages whose key bounds score highest for "
         "that query (docs/kv-quality.md measures --kv-page 4 --kv-recent 0.25 best)")
      ->check(integer_at_least(1))
      ->type_name("N")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-page",
         [cfg](int64_t p) {
           if (p <= 0) fail("--kv-page must be positive (got " + std::to_string(p) + ")");
           cfg->page = p;
           cfg->page_set = true;
         },
         "with --kv-resident: positions per page (default 16)")
      ->check(integer_at_least(1))
      ->type_name("P")
      ->group(group);
  cmd->add_option_function<std::string>(
         "--kv-page-select",
         [cfg](const std::string& s) {
           cfg->quest_select = parse_quest_select(s);
           cfg->page_set = true;
         },
         "with --kv-resident: choose pages per KV head (default) or once per layer for all heads")
      ->type_name("head|layer")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-sinks",
         [cfg](int64_t n) {
           cfg->sinks = n;
           cfg->sinks_set = true;
         },
         "h2o / tova / snapkv / streaming: first positions always kept (default 4)")
      ->check(integer_at_least(0))
      ->type_name("N")
      ->group(group);
  cmd->add_option_function<double>(
         "--kv-recent",
         [cfg](double f) {
           cfg->recent_fraction = f;
           cfg->recent_set = true;
         },
         "h2o / tova / snapkv / --kv-resident: fraction of the budget kept for the most recent positions (h2o, snapkv "
         "default 0.25; tova default: only the newest; --kv-resident default: the newest page)")
      ->check(any_number())  // the range is checked with the other KV options
      ->type_name("F")
      ->group(group);
  cmd->add_option_function<int64_t>(
         "--kv-streaming",
         [cfg](int64_t w) {
           if (w <= 0) fail("--kv-streaming must be positive (got " + std::to_string(w) + ")");
           cfg->window = w;
           cfg->streaming = true;
         },
         "StreamingLLM preset: W positions = the sinks + a window of the last W - sinks")
      ->check(integer_at_least(1))
      ->type_name("W")
      ->group(group);
}

void finalize_kv_options(KvConfig* cfg) {
  // Presets are applied by the option callbacks (--kv-streaming W is a window
  // of W that keeps the sinks); what remains is checking the combination.
  cfg->validate();
}

}  // namespace flashmoe::cli
