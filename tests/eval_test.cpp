// flashmoe eval: perplexity / KL / recall on coder-mini, checked against
// quantities computed here independently, plus the CLI's JSON and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/eval.h"
#include "format/model_files.h"
#include "engine/session.h"
#include "kv/memory_calc.h"
#include "test_util.h"

namespace flashmoe::eval_test {
namespace {

using test::source_path;

struct CoderMini {
  std::unique_ptr<QwenModel> model;
  Tokenizer tok;
  std::vector<int32_t> heldout;  // the first tokens of code_heldout.txt
};

CoderMini& coder_mini() {
  static CoderMini* cm = [] {
    const ModelFiles p = resolve_model_files(source_path("models/coder-mini"));
    auto* c = new CoderMini{QwenModel::load(p.model_dir), Tokenizer::load(p.tokenizer_json), {}};
    std::ifstream f(source_path("models/coder-mini/eval/code_heldout.txt"), std::ios::binary);
    std::string text(20000, '\0');
    f.read(text.data(), std::streamsize(text.size()));
    text.resize(size_t(f.gcount()));
    // Cut at a newline so the slice is whole UTF-8 characters.
    text.resize(text.rfind('\n') + 1);
    c->heldout = c->tok.encode(text);
    return c;
  }();
  return *cm;
}

TEST(EvalPaths, BothLayoutsResolve) {
  const ModelFiles a = resolve_model_files(source_path("models/coder-mini"));
  const ModelFiles b = resolve_model_files(source_path("models/coder-mini/model"));
  EXPECT_EQ(std::filesystem::path(a.model_dir), std::filesystem::path(b.model_dir));
  EXPECT_EQ(std::filesystem::path(a.tokenizer_json).filename(), "tokenizer.json");
  EXPECT_EQ(std::filesystem::canonical(a.tokenizer_json), std::filesystem::canonical(b.tokenizer_json));
  EXPECT_THROW(resolve_model_files(source_path("models/no-such-model")), Error);
  EXPECT_THROW(resolve_model_files(source_path("tests")), Error);
}

// Independent log-softmax, in long double.
double ref_nll(const float* x, int64_t V, int32_t t) {
  long double mx = x[0];
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > mx) mx = x[i];
  long double s = 0;
  for (int64_t i = 0; i < V; ++i) s += std::exp((long double)x[i] - mx);
  return double(-((long double)x[t] - mx - std::log(s)));
}

// (Windows of 128 tokens instead of 256 under the sanitizers.)
TEST(Eval, PerplexityMatchesFeedAllByHand) {
  CoderMini& cm = coder_mini();
  ASSERT_GE(cm.heldout.size(), 512u);
  const int W = test::sanitizer_build() ? 128 : 256;
  ThreadPool pool(2);
  PerplexityOptions po;
  po.window_tokens = W;
  po.max_windows = 2;
  const PerplexityResult r = eval_perplexity(test::cpu_of(*cm.model), cm.heldout, KvConfig{}, pool, po);
  EXPECT_EQ(r.windows, 2);
  EXPECT_EQ(r.scored, 2 * (W - 1));
  EXPECT_EQ(r.mean_kl, 0.0);
  EXPECT_GT(r.kv_bytes, 0u);

  const int64_t V = cm.model->config().vocab_size;
  double nll = 0;
  for (int w = 0; w < 2; ++w) {
    std::vector<int32_t> win(cm.heldout.begin() + w * W, cm.heldout.begin() + (w + 1) * W);
    Session s(test::cpu_of(*cm.model), KvConfig{}, pool);
    const std::vector<float> logits = s.feed_all(win);
    for (int i = 0; i + 1 < W; ++i) nll += ref_nll(logits.data() + int64_t(i) * V, V, win[size_t(i + 1)]);
  }
  const double ppl = std::exp(nll / (2.0 * (W - 1)));
  EXPECT_NEAR(r.perplexity, ppl, 1e-6 * ppl);
  EXPECT_GT(ppl, 1.0);
  EXPECT_LT(ppl, 100.0);  // a trained model on code, not a random one (vocab 4096)
}

// The KV bytes eval reports are kv-calc's count for the longest sequence
// (computed, so the CPU and the GPU report the same number).
TEST(Eval, KvBytesAreKvCalcsCount) {
  CoderMini& cm = coder_mini();
  ThreadPool pool(2);
  PerplexityOptions po;
  po.window_tokens = 128;
  po.max_windows = 1;
  po.kl = false;
  KvConfig w;
  w.window = 48;
  const ModelConfig& c = cm.model->config();
  for (const KvConfig& kv : {KvConfig{}, w}) {
    const PerplexityResult r = eval_perplexity(test::cpu_of(*cm.model), cm.heldout, kv, pool, po);
    EXPECT_EQ(r.kv_bytes, size_t(kv_cache_bytes(c, kv, 128))) << kv.describe();
  }
  EXPECT_EQ(kv_cache_bytes(c, w, 128), kv_memory(c, w).bytes_per_position() * 48);
}

TEST(Eval, KlHelpers) {
  const float a[4] = {1, 2, 3, 4}, b[4] = {4, 3, 2, 1}, c[4] = {11, 12, 13, 14};
  EXPECT_NEAR(kl_of(a, a, 4), 0.0, 1e-12);
  EXPECT_NEAR(kl_of(a, c, 4), 0.0, 1e-12);  // shift-invariant
  EXPECT_GT(kl_of(a, b, 4), 0.1);
  // log-softmax of {0, ln 3}: p = {1/4, 3/4}
  const float d[2] = {0.f, float(std::log(3.0))};
  EXPECT_NEAR(nll_of(d, 2, 0), std::log(4.0), 1e-6);
}

TEST(Eval, MeanKlZeroForReferencePositiveForFp8) {
  CoderMini& cm = coder_mini();
  ThreadPool pool(2);
  PerplexityOptions po;
  po.window_tokens = test::sanitizer_build() ? 128 : 256;
  po.max_windows = 1;
  KvConfig fp8;
  fp8.dtype = KvDType::FP8;
  EXPECT_TRUE(is_reference_kv(KvConfig{}));
  EXPECT_FALSE(is_reference_kv(fp8));
  const PerplexityResult ref = eval_perplexity(test::cpu_of(*cm.model), cm.heldout, KvConfig{}, pool, po);
  const PerplexityResult q = eval_perplexity(test::cpu_of(*cm.model), cm.heldout, fp8, pool, po);
  EXPECT_EQ(ref.mean_kl, 0.0);
  EXPECT_GT(q.mean_kl, 0.0);
  EXPECT_LT(q.mean_kl, 0.05);
  EXPECT_LT(q.kv_bytes, ref.kv_bytes);
  // KL of a config against itself via the same code path is 0: bf16 KL is
  // small but the reference run itself is exact.
  PerplexityOptions no_kl = po;
  no_kl.kl = false;
  EXPECT_EQ(eval_perplexity(test::cpu_of(*cm.model), cm.heldout, fp8, pool, no_kl).mean_kl, 0.0);
}

// KL guard for fp8 `channel` on coder-mini (the eval of docs/kv-quality.md,
// shortened): 2 windows of 512 tokens of held-out code. Its KL must stay
// under issue 24's 1e-3 and well under plain per-position scales' (the
// full 4 x 2,048 eval: 4.3e-4 against 1.4e-3; here 4.3e-4 against 1.0e-3).
// Broken offsets, scales stored in a narrower type than they were chosen
// in, or key roundings that no longer see the queries fail it.
TEST(Eval, Fp8ChannelKlGuard) {
  if (test::sanitizer_build()) GTEST_SKIP() << "too slow under the sanitizers";
  CoderMini& cm = coder_mini();
  ThreadPool pool(2);
  PerplexityOptions po;
  po.window_tokens = 512;
  po.max_windows = 2;
  KvConfig pos, ch;
  pos.dtype = ch.dtype = KvDType::FP8;
  ch.fp8_scale = Fp8ScaleMode::Channel;
  ch.fp8_scale_set = true;
  const PerplexityResult rp = eval_perplexity(test::cpu_of(*cm.model), cm.heldout, pos, pool, po);
  const PerplexityResult rc = eval_perplexity(test::cpu_of(*cm.model), cm.heldout, ch, pool, po);
  std::printf("fp8 mean KL over 2 x 512: channel %.3e, position %.3e\n", rc.mean_kl, rp.mean_kl);
  EXPECT_GT(rc.mean_kl, 0.0);
  EXPECT_LT(rc.mean_kl, 1e-3);
  EXPECT_LT(rc.mean_kl, 0.6 * rp.mean_kl) << "channel " << rc.mean_kl << " position " << rp.mean_kl;
}

// --score-from S: the first S tokens of each window are a prompt, the rest
// are decoded one at a time and scored. The f32 full cache gives the
// by-hand NLL of those positions; SnapKV (which compresses only when
// decoding starts) is the full cache when the whole window is the prompt
// (KL exactly 0) and not once it decodes with 32 of 64+ positions.
TEST(Eval, ScoreFromDecodesTheTail) {
  CoderMini& cm = coder_mini();
  const int64_t W = 128, S = 64, V = cm.model->config().vocab_size;
  ThreadPool pool(2);
  PerplexityOptions po;
  po.window_tokens = W;
  po.max_windows = 1;
  po.score_from = S;
  const PerplexityResult r = eval_perplexity(test::cpu_of(*cm.model), cm.heldout, KvConfig{}, pool, po);
  EXPECT_EQ(r.scored, W - 1 - S);
  const std::vector<int32_t> win(cm.heldout.begin(), cm.heldout.begin() + W);
  Session s(test::cpu_of(*cm.model), KvConfig{}, pool);
  const std::vector<float> logits = s.feed_all(win);
  double nll = 0;
  for (int64_t i = S; i + 1 < W; ++i) nll += ref_nll(logits.data() + i * V, V, win[size_t(i + 1)]);
  const double ppl = std::exp(nll / double(W - 1 - S));
  EXPECT_NEAR(r.perplexity, ppl, 1e-4 * ppl);

  KvConfig snap;
  snap.snapkv_budget = 32;
  po.score_from = 0;
  EXPECT_EQ(eval_perplexity(test::cpu_of(*cm.model), cm.heldout, snap, pool, po).mean_kl, 0.0);
  po.score_from = S;
  EXPECT_GT(eval_perplexity(test::cpu_of(*cm.model), cm.heldout, snap, pool, po).mean_kl, 1e-4);
  po.score_from = W - 1;
  EXPECT_THROW(eval_perplexity(test::cpu_of(*cm.model), cm.heldout, KvConfig{}, pool, po), Error);
}

TEST(Eval, PerplexityErrors) {
  CoderMini& cm = coder_mini();
  ThreadPool pool(1);
  PerplexityOptions po;
  po.window_tokens = cm.model->config().max_position_embeddings + 1;
  try {
    eval_perplexity(test::cpu_of(*cm.model), cm.heldout, KvConfig{}, pool, po);
    FAIL() << "no error for a window longer than the context";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos) << e.what();
  }
  po.window_tokens = int64_t(cm.heldout.size()) + 1;
  try {
    eval_perplexity(test::cpu_of(*cm.model), cm.heldout, KvConfig{}, pool, po);
    FAIL() << "no error for text shorter than a window";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fewer than one window"), std::string::npos) << e.what();
  }
}

TEST(Eval, RecallFirstFourLinesF32Full) {
  CoderMini& cm = coder_mini();
  ThreadPool pool(2);
  std::vector<RecallItem> all = load_recall_jsonl(source_path("models/coder-mini/eval/recall_dev.jsonl"));
  ASSERT_EQ(all.size(), 40u);
  std::vector<RecallItem> items(all.begin(), all.begin() + 4);
  const RecallResult r = eval_recall(test::cpu_of(*cm.model), cm.tok, items, KvConfig{}, pool);
  ASSERT_EQ(r.outputs.size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(r.outputs[i].substr(0, items[i].answer.size()), items[i].answer) << "item " << i;
  EXPECT_EQ(r.correct, 4);
  EXPECT_EQ(r.total, 4);
  ASSERT_EQ(r.by_filler.count(64), 1u);
  EXPECT_EQ(r.by_filler.at(64).correct, 4);
  EXPECT_GT(r.decode_tokens, 0);
  EXPECT_GT(r.decode_tokens_per_s(), 0.0);
}

TEST(Eval, RecallJsonlErrorsNameTheLine) {
  test::TempDir d;
  const std::string f = d.path + "/r.jsonl";
  auto expect_error = [&](const std::string& body, const std::string& needle) {
    test::write_file(f, body);
    try {
      load_recall_jsonl(f);
      ADD_FAILURE() << "no error for: " << body;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string good = R"({"prompt": "x = ", "answer": "1", "filler_tokens": 64})";
  expect_error("", "empty");
  expect_error("\n\n", "no items");
  expect_error(good + "\n{not json\n", "line 2");
  expect_error(good + "\n" + good + "\n" + R"({"prompt": "x", "filler_tokens": 64})" + "\n", "line 3: \"answer\"");
  expect_error(R"({"prompt": "x", "answer": "1", "filler_tokens": "many"})", "line 1: \"filler_tokens\"");
  expect_error("[1, 2]", "line 1: expected a JSON object");
  EXPECT_THROW(load_recall_jsonl(d.path + "/missing.jsonl"), Error);
  test::write_file(f, good + "\n\n" + good + "\n");
  EXPECT_EQ(load_recall_jsonl(f).size(), 2u);
}

// --- the CLI ---

std::string q(const std::string& s) { return "'" + s + "'"; }

TEST(EvalCli, JsonHasTheKeys) {
  test::TempDir d;
  // Two short recall items (filler 64) in a scratch file.
  std::ifstream in(source_path("models/coder-mini/eval/recall_dev.jsonl"));
  std::string l1, l2;
  std::getline(in, l1);
  std::getline(in, l2);
  test::write_file(d.path + "/r.jsonl", l1 + "\n" + l2 + "\n");
  const test::CmdResult r = test::run_flashmoe(
      "eval -m " + q(source_path("models/coder-mini")) + " -t 2 --kv-dtype fp8 --perplexity " +
      q(source_path("models/coder-mini/eval/code_heldout.txt")) + " --window-tokens 128 --max-windows 1 --recall " +
      q(d.path + "/r.jsonl") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(r.out)) << r.out;
  ASSERT_TRUE(j.is_object());
  for (const char* k : {"perplexity", "mean_kl", "recall", "kv_bytes", "decode_tokens_per_s"})
    EXPECT_TRUE(j.contains(k)) << k << " missing in " << r.out;
  EXPECT_GT(j["perplexity"].get<double>(), 1.0);
  EXPECT_GT(j["mean_kl"].get<double>(), 0.0);
  EXPECT_GT(j["kv_bytes"].get<int64_t>(), 0);
  ASSERT_TRUE(j["recall"].contains("64")) << r.out;
  EXPECT_EQ(j["recall"]["64"]["total"].get<int>(), 2);
  EXPECT_EQ(j["recall"]["64"]["correct"].get<int>(), 2);
  EXPECT_NE(r.err.find("[perplexity] window 1/1"), std::string::npos) << r.err;
}

TEST(EvalCli, OnlyWhatWasAsked) {
  test::TempDir d;
  std::ifstream in(source_path("models/coder-mini/eval/recall_dev.jsonl"));
  std::string l1;
  std::getline(in, l1);
  test::write_file(d.path + "/r.jsonl", l1 + "\n");
  const test::CmdResult r = test::run_flashmoe("eval -q -m " + q(source_path("models/coder-mini/model")) +
                                               " -t 2 --recall " + q(d.path + "/r.jsonl") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j.contains("perplexity"));
  EXPECT_FALSE(j.contains("mean_kl"));
  EXPECT_TRUE(j.contains("recall"));
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST(EvalCli, Errors) {
  test::TempDir d;
  const std::string m = " -m " + q(source_path("models/coder-mini"));
  auto expect = [&](const std::string& args, const std::string& needle) {
    const test::CmdResult r = test::run_flashmoe("eval -q" + m + " " + args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\n" << r.err;
  };
  expect("", "--perplexity");
  expect("--perplexity " + q(d.path + "/missing.txt"), "not found");
  test::write_file(d.path + "/empty.txt", "");
  expect("--perplexity " + q(d.path + "/empty.txt"), "empty");
  test::write_file(d.path + "/bad.jsonl", R"({"prompt": "a", "answer": "1", "filler_tokens": 1})" "\nnope\n");
  expect("--recall " + q(d.path + "/bad.jsonl"), "line 2");
  expect("--perplexity " + q(source_path("models/coder-mini/eval/code_heldout.txt")) + " --window-tokens 70000",
         "context");
  const test::CmdResult r = test::run_flashmoe("eval -q -m " + q(d.path) + " --recall x.jsonl");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("config.json"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace flashmoe::eval_test
