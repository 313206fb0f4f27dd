// The forward pass against HF transformers' own outputs on every fixture.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/session.h"
#include "test_util.h"

namespace golden_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

const char* kFixtures[] = {"tiny-qwen35moe",  "tiny-qwen35moe-fused", "tiny-qwen35moe-text",
                           "tiny-qwen35-dense", "tiny-qwen3next",      "tiny-qwen3next-sharded"};

class Golden : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    dir_ = fixture_dir(GetParam());
    ref_ = dir_ + "/reference.safetensors";
    model_ = QwenModel::load(dir_ + "/model");
  }
  std::string dir_, ref_;
  std::unique_ptr<QwenModel> model_;
  ThreadPool pool_{2};
};

TEST_P(Golden, LogitsShortAndHiddenStates) {
  RefTensor ids = load_ref(ref_, "ids_short"), logits = load_ref(ref_, "logits_short");
  RefTensor hidden = load_ref(ref_, "hidden_short");
  const Backend& cpu = cpu_of(*model_);
  auto st = cpu.new_state(KvConfig{});
  std::vector<float> got(ids.ids.size() * size_t(model_->config().vocab_size));
  std::vector<std::vector<float>> captured;
  cpu.forward_capturing(*st, ids.ids.data(), int64_t(ids.ids.size()), LogitsMode::All, got.data(), pool_, &captured);
  ASSERT_EQ(got.size(), logits.f32.size());
  EXPECT_LE(max_abs_diff(got.data(), logits.f32.data(), got.size()), 1e-3f);

  // Layer by layer: index 0 = embeddings, i = residual after layer i. The last
  // entry is after the final norm in some HF versions: accept either.
  const auto& cap = captured;
  const int64_t L = model_->config().num_layers, H = model_->config().hidden_size;
  const size_t per_layer = ids.ids.size() * size_t(H);
  ASSERT_EQ(hidden.shape[0], L + 1);
  for (int64_t l = 0; l < L; ++l)
    EXPECT_LE(max_abs_diff(cap[l].data(), hidden.f32.data() + l * per_layer, per_layer), 1e-4f) << "layer " << l;
  std::vector<float> normed(cap[L]);
  const auto& fn = model_->weights().final_norm;
  for (size_t t = 0; t < ids.ids.size(); ++t) {
    float* x = normed.data() + t * H;
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += double(x[i]) * x[i];
    float r = float(1.0 / std::sqrt(ss / double(H) + model_->config().rms_norm_eps));
    for (int64_t i = 0; i < H; ++i) x[i] = x[i] * r * (1.0f + fn[i]);
  }
  const float* last = hidden.f32.data() + L * per_layer;
  float d = std::min(max_abs_diff(cap[L].data(), last, per_layer), max_abs_diff(normed.data(), last, per_layer));
  EXPECT_LE(d, 1e-3f) << "final hidden state";
}

TEST_P(Golden, LogitsLong) {
  RefTensor ids = load_ref(ref_, "ids_long"), logits = load_ref(ref_, "logits_long");
  Session s(cpu_of(*model_), KvConfig{}, pool_);
  std::vector<float> got = s.feed_all(ids.ids);
  ASSERT_EQ(got.size(), logits.f32.size());
  EXPECT_LE(max_abs_diff(got.data(), logits.f32.data(), got.size()), 1e-3f);
}

TEST_P(Golden, GreedyMatchesHfGenerate) {
  RefTensor prompt = load_ref(ref_, "prompt"), greedy = load_ref(ref_, "greedy");
  Session s(cpu_of(*model_), KvConfig{}, pool_);
  const int64_t V = model_->config().vocab_size;
  std::vector<int32_t> out;
  const std::vector<float>* logits = &s.feed(prompt.ids);
  for (size_t i = 0; i < greedy.ids.size(); ++i) {
    out.push_back(argmax(logits->data(), V));
    logits = &s.feed({out.back()});
  }
  EXPECT_EQ(out, greedy.ids);
}

TEST_P(Golden, TokenByTokenDecodeEqualsPrefill) {
  RefTensor ids = load_ref(ref_, "ids_long");
  const int64_t V = model_->config().vocab_size;
  Session prefill(cpu_of(*model_), KvConfig{}, pool_), step(cpu_of(*model_), KvConfig{}, pool_);
  std::vector<float> all = prefill.feed_all(ids.ids);
  float worst = 0;
  for (size_t t = 0; t < ids.ids.size(); ++t) {
    const std::vector<float>& l = step.feed({ids.ids[t]});
    worst = std::max(worst, max_abs_diff(l.data(), all.data() + t * V, size_t(V)));
  }
  EXPECT_LE(worst, 1e-4f);
  EXPECT_EQ(step.position(), int64_t(ids.ids.size()));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Golden, ::testing::ValuesIn(kFixtures),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) if (c == '-') c = '_';
                           return n;
                         });

TEST(GoldenCoderMini, LogitsMatchReference) {
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  RefTensor ids = load_ref(dir + "/reference.safetensors", "ids");
  RefTensor logits = load_ref(dir + "/reference.safetensors", "logits");
  ThreadPool pool(2);
  Session s(cpu_of(*model), KvConfig{}, pool);
  std::vector<float> got = s.feed_all(ids.ids);
  EXPECT_LE(max_abs_diff(got.data(), logits.f32.data(), got.size()), 1e-3f);
}

// Splitting a prompt into a prefill and a continuation must not change anything.
TEST(GoldenCoderMini, PrefillThenContinueEqualsOnePrefill) {
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  RefTensor ids = load_ref(dir + "/reference.safetensors", "ids");
  ThreadPool pool(2);
  const int64_t V = model->config().vocab_size;
  Session one(cpu_of(*model), KvConfig{}, pool), two(cpu_of(*model), KvConfig{}, pool);
  std::vector<float> all = one.feed_all(ids.ids);
  std::vector<int32_t> a(ids.ids.begin(), ids.ids.begin() + 100), b(ids.ids.begin() + 100, ids.ids.end());
  two.feed(a);
  std::vector<float> rest = two.feed_all(b);
  EXPECT_LE(max_abs_diff(rest.data(), all.data() + 100 * V, rest.size()), 1e-4f);
}

}  // namespace

}  // namespace golden_test
