// Quality measurements of a KV-cache configuration on a trained model:
// perplexity and mean KL against the unmodified f32 cache over fixed windows
// of held-out text, and greedy recall of values defined N tokens earlier.
// Used by `flashmoe eval`; free of the CLI so tests can call it directly.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "kv/kv_config.h"
#include "runtime/backend.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe {


// Called with a short progress line (no newline) as work advances.
using EvalProgress = std::function<void(const std::string&)>;

// True for the configuration mean KL is measured against (f32, full cache).
bool is_reference_kv(const KvConfig& kv);

struct PerplexityOptions {
  int64_t window_tokens = 2048;
  int64_t max_windows = 0;  // 0: every full window of the text
  // > 0: each window's first score_from tokens are fed as one prompt and
  // the others one at a time (decoding), and only the predictions made at
  // positions >= score_from are scored. llama-perplexity scores the second
  // half of each chunk, so 1024 with windows of 2048 compares the same
  // positions; and prompt-compression policies (snapkv) compress there.
  int64_t score_from = 0;
  bool kl = true;           // also run the f32-full reference and measure KL
  // Where the f32-full reference runs; null: on the measured backend. Another
  // backend when the measured one changes the model itself (eval --moe-top-k:
  // the reference is the model at its own top-k); KL is then measured even
  // for the f32-full cache.
  const Backend* reference = nullptr;
};

struct PerplexityResult {
  double perplexity = 0;    // exp(mean NLL)
  double mean_nll = 0;
  double mean_kl = 0;       // mean KL(P_f32_full || P_config) over the scored positions; 0 for the reference
  int64_t windows = 0;
  int64_t scored = 0;       // positions scored: windows * (window_tokens - 1)
  size_t kv_bytes = 0;      // KV bytes at the end of a window (see eval_kv_bytes)
};

// Splits `ids` into consecutive windows of opt.window_tokens (a trailing
// partial window is dropped), evaluates each from a fresh session: the NLL of
// token i+1 given tokens 0..i, and (unless kv is the reference) the KL of
// the next-token distribution against an f32 full-cache session over the
// same window. Throws Error when the text is shorter than one window or the
// window exceeds the model's context. Every session runs on `model`'s
// backend, the reference too unless opt.reference names another.
PerplexityResult eval_perplexity(const Backend& model, const std::vector<int32_t>& ids, const KvConfig& kv,
                                 ThreadPool& pool, const PerplexityOptions& opt, const EvalProgress& progress = {});

// The KV bytes an eval reports for a sequence of `tokens`: bytes per
// retained position x positions retained, as `kv-calc` computes them from
// the model config and the KvConfig. Computed rather than read from the
// session's state so that every device reports the same number for the
// same configuration (the CPU and the GPU lay out and grow their storage
// differently, and the GPU's is not visible from here).
size_t eval_kv_bytes(const ModelConfig& cfg, const KvConfig& kv, int64_t tokens);

// Per-position helpers (exposed for tests): logits are one row of [vocab].
double nll_of(const float* logits, int64_t vocab, int32_t target);
double kl_of(const float* ref_logits, const float* logits, int64_t vocab);  // KL(softmax(ref) || softmax(logits))

struct RecallItem {
  std::string prompt, answer;
  int64_t filler_tokens = 0;
};
// Reads {prompt, answer, filler_tokens} per line; errors name the line.
// Blank lines are skipped. Throws Error for a missing or empty file.
std::vector<RecallItem> load_recall_jsonl(const std::string& path);

struct RecallCount {
  int64_t correct = 0, total = 0;
};
struct RecallResult {
  std::map<int64_t, RecallCount> by_filler;  // keyed by filler_tokens
  int64_t correct = 0, total = 0;
  int64_t decode_tokens = 0;      // single-token steps after the prompts
  double decode_seconds = 0;
  size_t kv_bytes = 0;            // largest KV bytes at the end of an item (see eval_kv_bytes)
  std::vector<std::string> outputs;  // decoded continuation per item
  double decode_tokens_per_s() const { return decode_seconds > 0 ? double(decode_tokens) / decode_seconds : 0; }
};

// For each item: feed the encoded prompt, greedily generate
// (tokens of the answer + 2) tokens, and count it correct when the decoded
// continuation starts with the answer (decoding through Session::greedy,
// on a GPU without host round trips).
RecallResult eval_recall(const Backend& model, const Tokenizer& tok, const std::vector<RecallItem>& items,
                         const KvConfig& kv, ThreadPool& pool, const EvalProgress& progress = {});

// Tokens of a text file; throws Error for a missing or empty file.
std::vector<int32_t> tokenize_file(const Tokenizer& tok, const std::string& path);

}  // namespace flashmoe
