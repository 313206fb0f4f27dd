// KV policies that were CPU-only, on the GPU against the CPU's KvCache:
// SnapKV (--kv-snapkv B, also over fp8 `rotated` storage) keeps the same
// prompt positions in every full-attention layer and decodes to the same
// logits. (fp8 `rotated` alone: kv_cases() in cuda_test.cpp.) Skipped (with the
// reason) where no GPU is usable, e.g. in CI.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "core/argmax.h"
#include "engine/session.h"
#include "test_util.h"

namespace cuda_kv_policies_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

struct SnapCase {
  const char* name;
  KvConfig kv;
  size_t prompt;  // tokens of the reference prompt fed
};

std::vector<SnapCase> snap_cases() {
  std::vector<SnapCase> v;
  KvConfig a;
  a.snapkv_budget = 64;  // default 4 sinks, window 16
  v.push_back({"f32-64", a, 256});
  KvConfig b;
  b.snapkv_budget = 40;
  b.sinks = 1;
  b.recent_fraction = 0.5;
  b.recent_set = true;
  b.dtype = KvDType::BF16;
  v.push_back({"bf16-40-sink1-recent0.5", b, 256});
  KvConfig f;
  f.snapkv_budget = 48;
  f.dtype = KvDType::FP8;
  f.fp8_scale = Fp8ScaleMode::Head;
  v.push_back({"fp8-head-48", f, 256});
  f.fp8_scale = Fp8ScaleMode::Rotated;
  v.push_back({"fp8-rotated-48", f, 256});
  v.push_back({"f32-64-short-prompt", a, 40});  // kept whole, then the window
  return v;
}

}  // namespace

// After a 256-token prompt (through the batched prefill in one chunk, or in
// chunks of 7, so the last 32 queries span chunks) and at each of 24 decoded
// tokens (the window wraps), every full-attention layer holds the CPU's
// positions and the logits agree; a snapshot taken after the cut and one
// taken before it restore and continue bitwise.
TEST(CudaKvPolicies, SnapKvKeepsTheCpusPositions) {
  REQUIRE_GPU();
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  RefTensor ids = load_ref(dir + "/reference.safetensors", "ids");
  const int64_t V = model->config().vocab_size;
  const size_t layers = size_t(model->plan().attention_layers);
  ASSERT_GT(layers, 0u);
  ThreadPool pool(2);
  for (int chunk : {0, 7}) {
    CudaOptions o;
    if (chunk) o.decode.prefill_chunk = chunk;
    auto cuda = CudaModel::upload(*model, o);
    for (const SnapCase& c : snap_cases()) {
      const std::string label = std::string(c.name) + (chunk ? " chunks of 7" : "");
      const std::vector<int32_t> prompt(ids.ids.begin(), ids.ids.begin() + std::ptrdiff_t(c.prompt));
      Session cpu(cpu_of(*model), c.kv, pool), gpu(gpu_view(*model, *cuda), c.kv, pool);
      std::vector<float> a = cpu.feed(prompt), b = gpu.feed(prompt);
      const SessionSnapshot before_cut = gpu.snapshot();
      auto same_positions = [&](const std::string& when) {
        for (size_t l = 0; l < layers; ++l) {
          const std::vector<int64_t> want = cpu.state().kv_positions(int(l));
          EXPECT_EQ(gpu.state().kv_positions(int(l)), want) << label << " " << when << ", layer " << l;
        }
      };
      const float tol = c.kv.dtype == KvDType::F32 ? 2e-3f : c.kv.dtype == KvDType::BF16 ? 1e-2f : 5e-2f;
      std::vector<int32_t> fed;
      SessionSnapshot after_cut;
      for (int step = 0; step < 24; ++step) {
        EXPECT_LE(max_abs_diff(a.data(), b.data(), size_t(V)), tol) << label << " step " << step;
        const int32_t next = int32_t(argmax(a.data(), V));
        fed.push_back(next);
        a = cpu.feed({next});
        b = gpu.feed({next});
        if (step == 0) same_positions("after the cut");
        if (step == 3) after_cut = gpu.snapshot();
      }
      same_positions("after 24 decoded tokens");
      ASSERT_EQ(int64_t(cpu.state().kv_positions(0).size()), c.kv.snapkv_budget) << label;
      // Restored snapshots continue exactly as the original did.
      Session r1(gpu_view(*model, *cuda), c.kv, pool), r2(gpu_view(*model, *cuda), c.kv, pool);
      r1.restore(after_cut);
      std::vector<float> x;
      for (size_t i = 4; i < fed.size(); ++i) x = r1.feed({fed[i]});
      EXPECT_EQ(max_abs_diff(x.data(), b.data(), size_t(V)), 0.0f) << label << " restored after the cut";
      for (size_t l = 0; l < layers; ++l)
        EXPECT_EQ(r1.state().kv_positions(int(l)), gpu.state().kv_positions(int(l))) << label;
      r2.restore(before_cut);
      for (int32_t t : fed) x = r2.feed({t});
      EXPECT_EQ(max_abs_diff(x.data(), b.data(), size_t(V)), 0.0f) << label << " restored before the cut";
    }
  }
}

}  // namespace cuda_kv_policies_test
