#include "engine/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/session.h"
#include "kv/memory_calc.h"

namespace flashmoe {

namespace fs = std::filesystem;

bool is_reference_kv(const KvConfig& kv) {
  return kv.dtype == KvDType::F32 && kv.retention() == KvRetention::Full;
}

double nll_of(const float* x, int64_t vocab, int32_t target) {
  double mx = x[0];
  for (int64_t i = 1; i < vocab; ++i) mx = std::max(mx, double(x[i]));
  double s = 0;
  for (int64_t i = 0; i < vocab; ++i) s += std::exp(double(x[i]) - mx);
  return -(double(x[target]) - mx - std::log(s));
}

double kl_of(const float* ref, const float* x, int64_t vocab) {
  double mr = ref[0], mq = x[0];
  for (int64_t i = 1; i < vocab; ++i) {
    mr = std::max(mr, double(ref[i]));
    mq = std::max(mq, double(x[i]));
  }
  double sr = 0, sq = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    sr += std::exp(double(ref[i]) - mr);
    sq += std::exp(double(x[i]) - mq);
  }
  const double lzr = mr + std::log(sr), lzq = mq + std::log(sq);
  double kl = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const double lp = double(ref[i]) - lzr, lq = double(x[i]) - lzq;
    kl += std::exp(lp) * (lp - lq);
  }
  return std::max(kl, 0.0);  // rounding can leave a tiny negative for identical rows
}

// The logits after every token of `win` ([W, vocab]): the whole window as one
// prompt, or with score_from > 0 the first score_from tokens as the prompt
// and the others fed one at a time, as decoding feeds them (rows before
// score_from are left 0: they are not scored).
static std::vector<float> feed_window(Session& s, const std::vector<int32_t>& win, int64_t score_from) {
  if (score_from == 0) return s.feed_all(win);
  const int64_t W = int64_t(win.size()), V = s.backend().config().vocab_size;
  std::vector<float> logits(size_t(W * V), 0.0f);
  s.feed(std::vector<int32_t>(win.begin(), win.begin() + score_from));
  for (int64_t i = score_from; i < W; ++i) {
    const std::vector<float>& l = s.feed({win[size_t(i)]});
    std::copy(l.begin(), l.end(), logits.begin() + i * V);
  }
  return logits;
}

size_t eval_kv_bytes(const ModelConfig& cfg, const KvConfig& kv, int64_t tokens) {
  return size_t(kv_cache_bytes(cfg, kv, tokens));
}

PerplexityResult eval_perplexity(const Backend& model, const std::vector<int32_t>& ids, const KvConfig& kv,
                                 ThreadPool& pool, const PerplexityOptions& opt, const EvalProgress& progress) {
  const int64_t W = opt.window_tokens;
  const int64_t ctx = model.config().max_position_embeddings;
  if (W < 2) fail("--window-tokens must be at least 2 (got " + std::to_string(W) + ")");
  if (ctx > 0 && W > ctx)
    fail("--window-tokens " + std::to_string(W) + " is longer than the model's context (max_position_embeddings = " +
         std::to_string(ctx) + ")");
  int64_t n_win = int64_t(ids.size()) / W;
  if (n_win == 0)
    fail("the text has " + std::to_string(ids.size()) + " tokens, fewer than one window of " + std::to_string(W) +
         " (lower --window-tokens)");
  if (opt.score_from < 0 || opt.score_from >= W - 1)
    fail("--score-from " + std::to_string(opt.score_from) + " leaves nothing to score in windows of " +
         std::to_string(W) + " tokens (it must be below " + std::to_string(W - 1) + ")");
  if (opt.max_windows > 0) n_win = std::min(n_win, opt.max_windows);

  const int64_t V = model.config().vocab_size;
  const bool do_kl = opt.kl && (!is_reference_kv(kv) || opt.reference);
  const Backend& ref_model = opt.reference ? *opt.reference : model;
  if (ref_model.config().vocab_size != model.config().vocab_size)
    fail("eval: the reference model's vocabulary differs from the measured model's");
  const KvConfig ref_kv{};
  PerplexityResult r;
  double nll = 0, kl = 0;
  for (int64_t w = 0; w < n_win; ++w) {
    if (progress)
      progress("[perplexity] window " + std::to_string(w + 1) + "/" + std::to_string(n_win) +
               (w > 0 ? " (ppl so far " + std::to_string(std::exp(nll / double(r.scored))) + ")" : ""));
    const std::vector<int32_t> win(ids.begin() + w * W, ids.begin() + (w + 1) * W);
    std::vector<float> logits;
    {
      Session s(model, kv, pool);
      logits = feed_window(s, win, opt.score_from);
    }
    r.kv_bytes = std::max(r.kv_bytes, eval_kv_bytes(model.config(), kv, W));
    const int64_t i0 = opt.score_from;
    for (int64_t i = i0; i + 1 < W; ++i) nll += nll_of(logits.data() + i * V, V, win[size_t(i + 1)]);
    if (do_kl) {
      Session ref(ref_model, ref_kv, pool);
      const std::vector<float> ref_logits = feed_window(ref, win, opt.score_from);
      for (int64_t i = i0; i + 1 < W; ++i) kl += kl_of(ref_logits.data() + i * V, logits.data() + i * V, V);
    }
    r.scored += W - 1 - i0;
    r.windows = w + 1;
  }
  r.mean_nll = nll / double(r.scored);
  r.perplexity = std::exp(r.mean_nll);
  r.mean_kl = do_kl ? kl / double(r.scored) : 0.0;
  return r;
}

namespace {

std::string read_text_file(const std::string& path, const char* what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(std::string(what) + " not found: " + path);
  if (fs::is_directory(path, ec)) fail(std::string(what) + " is a directory: " + path);
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(std::string("cannot read ") + what + ": " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  if (s.empty()) fail(std::string(what) + " is empty: " + path);
  return s;
}

}  // namespace

std::vector<int32_t> tokenize_file(const Tokenizer& tok, const std::string& path) {
  const std::string text = read_text_file(path, "perplexity file");
  try {
    return tok.encode(text);
  } catch (const Error& e) {
    fail(path + ": " + e.what());
  }
}

std::vector<RecallItem> load_recall_jsonl(const std::string& path) {
  const std::string text = read_text_file(path, "recall file");
  std::vector<RecallItem> items;
  std::istringstream in(text);
  std::string line;
  size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = path + " line " + std::to_string(n) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(where + "not valid JSON (" + e.what() + ")");
    }
    if (!j.is_object()) fail(where + "expected a JSON object {prompt, answer, filler_tokens}");
    RecallItem it;
    if (!j.contains("prompt") || !j["prompt"].is_string()) fail(where + "\"prompt\" missing or not a string");
    if (!j.contains("answer") || !j["answer"].is_string()) fail(where + "\"answer\" missing or not a string");
    if (!j.contains("filler_tokens") || !j["filler_tokens"].is_number_integer())
      fail(where + "\"filler_tokens\" missing or not an integer");
    it.prompt = j["prompt"].get<std::string>();
    it.answer = j["answer"].get<std::string>();
    it.filler_tokens = j["filler_tokens"].get<int64_t>();
    if (it.prompt.empty()) fail(where + "\"prompt\" is empty");
    if (it.answer.empty()) fail(where + "\"answer\" is empty");
    items.push_back(std::move(it));
  }
  if (items.empty()) fail("recall file has no items: " + path);
  return items;
}

RecallResult eval_recall(const Backend& model, const Tokenizer& tok, const std::vector<RecallItem>& items,
                         const KvConfig& kv, ThreadPool& pool, const EvalProgress& progress) {
  using Clock = std::chrono::steady_clock;
  const int64_t ctx = model.config().max_position_embeddings;
  RecallResult r;
  for (size_t k = 0; k < items.size(); ++k) {
    const RecallItem& it = items[k];
    if (progress) progress("[recall] " + std::to_string(k) + "/" + std::to_string(items.size()));
    const std::vector<int32_t> prompt = tok.encode(it.prompt);
    const int64_t n_gen = int64_t(tok.encode(it.answer).size()) + 2;
    if (ctx > 0 && int64_t(prompt.size()) + n_gen > ctx)
      fail("recall item " + std::to_string(k + 1) + ": prompt of " + std::to_string(prompt.size()) +
           " tokens + " + std::to_string(n_gen) + " generated exceeds the model's context of " + std::to_string(ctx));
    Session s(model, kv, pool);
    s.feed(prompt);
    // The argmax after the prompt, then n_gen - 1 single-token steps, each
    // feeding the previous argmax (the last one is not fed).
    const auto t0 = Clock::now();
    const std::vector<int32_t> gen = s.greedy(n_gen);
    r.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    r.decode_tokens += n_gen - 1;
    r.kv_bytes = std::max(r.kv_bytes, eval_kv_bytes(model.config(), kv, s.position()));
    std::string out = tok.decode(gen);
    const bool ok = out.compare(0, it.answer.size(), it.answer) == 0;
    RecallCount& c = r.by_filler[it.filler_tokens];
    c.total++;
    r.total++;
    if (ok) {
      c.correct++;
      r.correct++;
    }
    r.outputs.push_back(std::move(out));
  }
  if (progress) progress("[recall] " + std::to_string(items.size()) + "/" + std::to_string(items.size()));
  return r;
}

}  // namespace flashmoe
