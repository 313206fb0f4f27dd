// --moe-top-k: fewer routed experts per token than the model was trained with.
// The routed FFN against a reference built here from the layer's own pieces
// (router softmax, top-K, renormalised weights, one SwiGLU per expert, the
// gated shared expert), the whole model against its unmodified self, eval's
// KL against the model at its own top-k, and the option's errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "core/error.h"
#include "engine/eval.h"
#include "engine/session.h"
#include "test_util.h"

namespace moe_top_k_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

const std::string kFixture = "tiny-qwen35moe";  // 16 experts, num_experts_per_tok 4, all layers MoE

std::unique_ptr<QwenModel> load_with_top_k(int64_t k) {
  ExpertOptions o;
  o.experts_per_token = k;
  return QwenModel::load(fixture_dir(kFixture) + "/model", o);
}

// out[t] = sum over the K most probable experts e of p_e / sum_K p * expert_e(x_t)
//          + sigmoid(shared_gate . x_t) * shared(x_t)
// with p = softmax(router x_t) in double precision, ties to the lower index.
std::vector<float> reference_moe(const QwenModel& m, int64_t layer, int64_t K, const std::vector<float>& x,
                                 int64_t n, ThreadPool& pool) {
  const ModelConfig& c = m.config();
  const FfnWeights& w = m.weights().layers[size_t(layer)].ffn;
  const int64_t H = c.hidden_size, E = c.num_experts;
  std::vector<float> logits(static_cast<size_t>(n * E));
  cpu::matmul(pool, w.router, x.data(), n, logits.data());
  std::vector<float> out(static_cast<size_t>(n * H), 0.0f), y(static_cast<size_t>(H));
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x.data() + t * H;
    std::vector<double> p(static_cast<size_t>(E));
    double mx = logits[size_t(t * E)], z = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double(logits[size_t(t * E + e)]));
    for (int64_t e = 0; e < E; ++e) z += p[size_t(e)] = std::exp(double(logits[size_t(t * E + e)]) - mx);
    for (double& v : p) v /= z;
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)]; });
    double kept = 0;
    for (int64_t j = 0; j < K; ++j) kept += p[size_t(order[size_t(j)])];
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = order[size_t(j)];
      ExpertBatch b = m.expert_store().fetch(layer, {e});
      cpu::dense_swiglu_ffn(b.experts[0], xt, 1, y.data(), pool);
      const double g = p[size_t(e)] / kept;
      for (int64_t i = 0; i < H; ++i) out[size_t(t * H + i)] += float(g * y[size_t(i)]);
    }
    if (w.has_shared) {
      cpu::dense_swiglu_ffn(w.shared, xt, 1, y.data(), pool);
      const double gate_logit = cpu::simd_dot_row(w.shared_gate, 0, xt);
      const double g = 1.0 / (1.0 + std::exp(-gate_logit));
      for (int64_t i = 0; i < H; ++i) out[size_t(t * H + i)] += float(g * y[size_t(i)]);
    }
  }
  return out;
}

TEST(MoeTopK, RoutedFfnKeepsTheKMostProbableExpertsRenormalised) {
  ThreadPool pool(2);
  const int64_t layer = 0, n = 3;
  for (int64_t K : {1, 2, 4}) {
    auto m = load_with_top_k(K);
    ASSERT_EQ(m->config().num_experts_per_tok, K);
    const int64_t H = m->config().hidden_size;
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(size_t(n * H));
    for (float& v : x) v = nd(rng);
    std::vector<float> got(size_t(n * H));
    const LayerWeights& lw = m->weights().layers[size_t(layer)];
    cpu::routed_moe_ffn(m->config(), lw.ffn, lw.ffn.has_shared, m->expert_store(), layer, x.data(), n, got.data(),
                        pool);
    const std::vector<float> want = reference_moe(*m, layer, K, x, n, pool);
    EXPECT_LE(max_abs_diff(got.data(), want.data(), got.size()), 2e-5f) << "K=" << K;
  }
}

TEST(MoeTopK, ModelValueChangesNothingAndFewerExpertsChangeTheLogits) {
  ThreadPool pool(2);
  const std::vector<int32_t> ids = {3, 17, 101, 7, 250, 9, 44, 12};
  auto own = QwenModel::load(fixture_dir(kFixture) + "/model");
  auto same = load_with_top_k(own->config().num_experts_per_tok);
  auto two = load_with_top_k(2);
  auto logits = [&](const QwenModel& m) { return Session(cpu_of(m), KvConfig{}, pool).feed_all(ids); };
  const std::vector<float> a = logits(*own), b = logits(*same), c = logits(*two);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(max_abs_diff(a.data(), b.data(), a.size()), 0.0f);
  EXPECT_GT(mean_kl(a, c, own->config().vocab_size), 1e-6);
}

TEST(MoeTopK, EvalMeasuresKlAgainstTheModelAtItsOwnTopK) {
  ThreadPool pool(2);
  auto own = QwenModel::load(fixture_dir(kFixture) + "/model");
  auto two = load_with_top_k(2);
  std::vector<int32_t> text(64);
  for (size_t i = 0; i < text.size(); ++i) text[i] = int32_t((i * 37 + 5) % 512);
  PerplexityOptions po;
  po.window_tokens = 32;
  const PerplexityResult self = eval_perplexity(cpu_of(*two), text, KvConfig{}, pool, po);
  EXPECT_EQ(self.mean_kl, 0.0);  // f32 full against itself: the reference
  po.reference = &cpu_of(*own);
  const PerplexityResult r = eval_perplexity(cpu_of(*two), text, KvConfig{}, pool, po);
  EXPECT_EQ(r.perplexity, self.perplexity);
  // The KL as the test computes it from the two models' logits.
  double kl = 0;
  for (int w = 0; w < 2; ++w) {
    const std::vector<int32_t> win(text.begin() + w * 32, text.begin() + (w + 1) * 32);
    const std::vector<float> p = Session(cpu_of(*own), KvConfig{}, pool).feed_all(win);
    const std::vector<float> q = Session(cpu_of(*two), KvConfig{}, pool).feed_all(win);
    const std::vector<float> p31(p.begin(), p.end() - 512), q31(q.begin(), q.end() - 512);
    kl += mean_kl(p31, q31, 512) * 31;
  }
  EXPECT_GT(r.mean_kl, 1e-6);
  EXPECT_NEAR(r.mean_kl, kl / 62, 1e-9);
}

TEST(MoeTopK, OutOfRangeIsAnErrorNamingTheOption) {
  ModelConfig c;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  for (int64_t k : {0, -1, 5}) {
    try {
      ModelConfig d = c;
      limit_experts_per_token(&d, k);
      ADD_FAILURE() << "K=" << k << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--moe-top-k " + std::to_string(k)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("(4)"), std::string::npos) << e.what();
    }
  }
  ModelConfig dense;
  EXPECT_THROW(limit_experts_per_token(&dense, 1), Error);
  EXPECT_THROW(load_with_top_k(5), Error);
}

TEST(MoeTopK, CliRefusesMoreExpertsThanTheModelHas) {
  TempDir out;
  const std::string base = "logits -m " + fixture_dir(kFixture) + "/model -t 1 --ids 1,2,3 -o " + out.path + "/l.st";
  CmdResult r = run_flashmoe(base + " --moe-top-k 5");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--moe-top-k 5: must be between 1 and the model's num_experts_per_tok (4)"), std::string::npos)
      << r.err;
  r = run_flashmoe(base + " --moe-top-k 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--moe-top-k"), std::string::npos) << r.err;
  r = run_flashmoe(base + " --moe-top-k 2");
  EXPECT_EQ(r.code, 0) << r.err;
}

}  // namespace

}  // namespace moe_top_k_test
