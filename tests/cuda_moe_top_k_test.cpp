// --moe-top-k on the GPU: the CUDA routers (the batched prefill's, the decode
// step's, the q4 experts' fused one) keep the same K experts with the same
// renormalised weights as the CPU. Skipped (with the reason) without a GPU.
#include <gtest/gtest.h>

#include <cstdio>

#include "engine/session.h"
#include "model/pack_model.h"
#include "test_util.h"

namespace cuda_moe_top_k_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

// Prompt through the batched prefill, then single-token decode steps, on
// both backends; fp32 math on both (the tolerances of cuda_test.cpp).
void expect_gpu_matches_cpu(const std::string& model_dir, int64_t k, const char* label) {
  ExpertOptions eo;
  eo.experts_per_token = k;
  auto model = QwenModel::load(model_dir, eo);
  ASSERT_EQ(model->config().num_experts_per_tok, k);
  RefTensor ids = load_ref(source_path("models/coder-mini/reference.safetensors"), "ids");
  const std::vector<int32_t> prompt(ids.ids.begin(), ids.ids.begin() + 24), rest(ids.ids.begin() + 24, ids.ids.end());
  const int64_t V = model->config().vocab_size;
  ThreadPool pool(2);
  auto gpu = gpu_of(*model);
  Session cpu(cpu_of(*model), KvConfig{}, pool), dev(*gpu, KvConfig{}, pool);
  std::vector<float> a = cpu.feed_all(prompt), b = dev.feed_all(prompt);
  for (int32_t t : rest) {
    const std::vector<float>& x = cpu.feed({t});
    a.insert(a.end(), x.begin(), x.end());
    const std::vector<float>& y = dev.feed({t});
    b.insert(b.end(), y.begin(), y.end());
  }
  ASSERT_EQ(a.size(), b.size());
  const double kl = mean_kl(a, b, V);
  const float mad = max_abs_diff(a.data(), b.data(), a.size());
  std::printf("[cuda-moe-top-k] %s K=%lld: mean KL %.3g, max |dlogit| %.3g\n", label, (long long)k, kl, mad);
  EXPECT_LE(kl, 1e-4) << label;
  EXPECT_LE(mad, 2e-3f) << label;
}

TEST(CudaMoeTopK, CoderMiniAtFewerExpertsMatchesCpu) {
  REQUIRE_GPU();
  for (int64_t k : {1, 2, 3}) expect_gpu_matches_cpu(source_path("models/coder-mini/model"), k, "bf16 experts");
}

TEST(CudaMoeTopK, Q4ExpertsAtFewerExpertsMatchCpu) {
  REQUIRE_GPU();
  TempDir tmp;
  PackOptions po;
  po.experts = QuantKind::Q4;
  pack_model(source_path("models/coder-mini/model"), tmp.path + "/q4", po);
  expect_gpu_matches_cpu(tmp.path + "/q4", 2, "q4 experts");
}

}  // namespace

}  // namespace cuda_moe_top_k_test
