// KV-cache storage formats and retention policies against HF's references:
// a sliding window must reproduce logits_long_window*, and FP8 storage must
// land far closer to HF's FP8 logits than to the exact ones.
#include <gtest/gtest.h>

#include "engine/session.h"
#include "test_util.h"

namespace kv_golden_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

std::vector<float> run(const QwenModel& m, const KvConfig& kv, const std::vector<int32_t>& ids) {
  ThreadPool pool(2);
  Session s(cpu_of(m), kv, pool);
  return s.feed_all(ids);
}

KvConfig window(int64_t w) {
  KvConfig c;
  c.window = w;
  return c;
}
KvConfig fp8(int64_t w = 0) {
  KvConfig c;
  c.dtype = KvDType::FP8;
  c.fp8_scale = Fp8ScaleMode::Position;
  c.window = w;
  return c;
}

// mean |engine - ref_fp8| <= 0.1 * mean |ref_exact - ref_fp8|
void expect_fp8_close(const std::vector<float>& got, const RefTensor& ref_fp8, const RefTensor& ref_exact) {
  ASSERT_EQ(got.size(), ref_fp8.f32.size());
  float to_fp8 = mean_abs_diff(got.data(), ref_fp8.f32.data(), got.size());
  float exact_gap = mean_abs_diff(ref_exact.f32.data(), ref_fp8.f32.data(), got.size());
  EXPECT_GT(exact_gap, 0.0f);
  EXPECT_LE(to_fp8, 0.1f * exact_gap) << "engine-vs-fp8 " << to_fp8 << ", exact-vs-fp8 " << exact_gap;
}

class KvGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(KvGolden, WindowAndFp8MatchHf) {
  const std::string dir = fixture_dir(GetParam()), ref = dir + "/reference.safetensors";
  auto model = QwenModel::load(dir + "/model");
  RefTensor ids = load_ref(ref, "ids_long");
  RefTensor exact = load_ref(ref, "logits_long"), w32 = load_ref(ref, "logits_long_window32");
  std::vector<float> got = run(*model, window(32), ids.ids);
  EXPECT_LE(max_abs_diff(got.data(), w32.f32.data(), got.size()), 1e-3f);
  // The window changes the result: the test would notice a policy that does nothing.
  EXPECT_GT(max_abs_diff(w32.f32.data(), exact.f32.data(), got.size()), 1e-2f);

  expect_fp8_close(run(*model, fp8(), ids.ids), load_ref(ref, "logits_long_fp8"), exact);
  expect_fp8_close(run(*model, fp8(32), ids.ids), load_ref(ref, "logits_long_fp8_window32"), w32);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, KvGolden,
                         ::testing::Values("tiny-qwen35moe", "tiny-qwen35moe-text", "tiny-qwen35-dense",
                                           "tiny-qwen3next"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) if (c == '-') c = '_';
                           return n;
                         });

TEST(KvGoldenCoderMini, Window64AndFp8MatchHf) {
  const std::string dir = source_path("models/coder-mini"), ref = dir + "/reference.safetensors";
  auto model = QwenModel::load(dir + "/model");
  RefTensor ids = load_ref(ref, "ids"), exact = load_ref(ref, "logits");
  RefTensor w64 = load_ref(ref, "logits_window64");
  std::vector<float> got = run(*model, window(64), ids.ids);
  EXPECT_LE(max_abs_diff(got.data(), w64.f32.data(), got.size()), 1e-3f);
  expect_fp8_close(run(*model, fp8(), ids.ids), load_ref(ref, "logits_fp8"), exact);
}

// The reference semantics are token by token: one batch must equal feeding
// the same prompt one token at a time, for every retention policy. (Under
// the sanitizers, the first 96 of the 256 tokens: still past every window
// and budget below, so eviction runs.)
TEST(KvPolicies, BatchEqualsTokenByToken) {
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  RefTensor ids = load_ref(dir + "/reference.safetensors", "ids");
  if (sanitizer_build()) ids.ids.resize(96);
  const int64_t V = model->config().vocab_size;
  // Full retention first: its prefill appends a whole chunk, then attends
  // each token over its causal prefix on two threads.
  KvConfig full_bf16;
  full_bf16.dtype = KvDType::BF16;
  std::vector<KvConfig> configs = {KvConfig{}, full_bf16, window(64), fp8(64)};
  KvConfig h2o;
  h2o.h2o_budget = 64;
  configs.push_back(h2o);
  KvConfig stream;
  stream.streaming = true;
  stream.window = 48;
  configs.push_back(stream);
  for (const KvConfig& kv : configs) {
    ThreadPool pool(2);
    Session batch(cpu_of(*model), kv, pool), step(cpu_of(*model), kv, pool);
    std::vector<float> all = batch.feed_all(ids.ids);
    float worst = 0;
    for (size_t t = 0; t < ids.ids.size(); ++t) {
      const std::vector<float>& l = step.feed({ids.ids[t]});
      worst = std::max(worst, max_abs_diff(l.data(), all.data() + t * V, size_t(V)));
    }
    EXPECT_LE(worst, 1e-4f) << kv.describe();
  }
}

// Measured, not assumed: KV bytes stay constant over a 20,000-token
// generation (2,000 under the sanitizers: the window still turns over 7
// times, and the sanitizers watch every eviction).
TEST(KvPolicies, BytesConstantOverLongGeneration) {
  auto model = QwenModel::load(fixture_dir("tiny-qwen35moe-text") + "/model");
  KvConfig h2o;
  h2o.h2o_budget = 128;
  const int tokens = sanitizer_build() ? 2000 : 20000;
  for (const KvConfig& kv : {window(256), h2o}) {
    ThreadPool pool(1);
    Session s(cpu_of(*model), kv, pool);
    const int64_t V = model->config().vocab_size;
    int32_t next = 1;
    int64_t bytes_at_start = 0;
    for (int i = 0; i < tokens; ++i) {
      next = argmax(s.feed({next}).data(), V);
      if (i == 300) bytes_at_start = s.state().bytes().kv;
      if (i > 300) {
        ASSERT_EQ(s.state().bytes().kv, bytes_at_start) << kv.describe() << " at token " << i;
      }
    }
    EXPECT_GT(bytes_at_start, 0);
    EXPECT_EQ(s.position(), tokens);
  }
}

}  // namespace

}  // namespace kv_golden_test
