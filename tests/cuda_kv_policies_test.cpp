// KV policies that were CPU-only, on the GPU against the CPU's KvCache:
// SnapKV (--kv-snapkv B, also over fp8 `rotated` storage) keeps the same
// prompt positions in every full-attention layer and decodes to the same
// logits; the Quest store (--kv-resident N --kv-page P) reads the same
// pages per layer and KV head at every token. (fp8 `rotated` alone: kv_cases() in cuda_test.cpp.) Skipped (with the
// reason) where no GPU is usable, e.g. in CI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "core/argmax.h"
#include "engine/session.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

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

namespace {

struct QuestCase {
  const char* name;
  KvConfig kv;
};

KvConfig quest_config(int64_t resident, int64_t page, KvDType dtype) {
  KvConfig k;
  k.resident = resident;
  k.page = page;
  k.page_set = true;
  k.dtype = dtype;
  return k;
}

// Every dtype the CPU's store takes but fp8 `channel` (CPU only), per KV
// head and per layer, with and without a recent share.
std::vector<QuestCase> quest_cases() {
  std::vector<QuestCase> v;
  v.push_back({"f32-64-page8", quest_config(64, 8, KvDType::F32)});
  KvConfig b = quest_config(64, 16, KvDType::BF16);
  b.quest_select = QuestSelect::Layer;
  v.push_back({"bf16-64-page16-layer", b});
  KvConfig h = quest_config(48, 4, KvDType::FP8);
  h.fp8_scale = Fp8ScaleMode::Head;
  h.recent_fraction = 0.25;
  h.recent_set = true;
  v.push_back({"fp8-head-48-page4-recent0.25", h});
  KvConfig p = quest_config(40, 4, KvDType::FP8);  // per-position scales
  v.push_back({"fp8-position-40-page4", p});
  KvConfig r = h;
  r.fp8_scale = Fp8ScaleMode::Rotated;
  v.push_back({"fp8-rotated-48-page4-recent0.25", r});
  KvConfig f = quest_config(64, 8, KvDType::F16);
  v.push_back({"f16-64-page8", f});
  return v;
}

// How two choices of slots differ: 0 when equal, else the pages (of P
// slots) in one and not the other, counted on both sides.
size_t pages_apart(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int64_t page) {
  std::vector<int64_t> d;
  std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(d));
  for (int64_t& x : d) x /= page;
  d.erase(std::unique(d.begin(), d.end()), d.end());
  return d.size();
}

}  // namespace

// The Quest store on the GPU against the CPU's: after every token of a
// 200-token prompt fed token by token, after the same prompt in one batched
// chunk and in chunks of 7 (chunks inside the resident budget attend in a
// batch, the others token by token), and at each of 24 decoded tokens, each
// full-attention layer and KV head reads the CPU's slots (KvCache::
// quest_selected) and the logits agree. The page bounds of the two sides
// come from keys that differ by fp32 rounding, so a near-tie at the cut
// could swap one page for another: such a swap (one page each way) is
// counted and allowed in at most 1% of the choices, and its step's logits
// are not compared; any other difference fails. A snapshot taken while
// decoding restores (the bounds recomputed from the stored keys) and
// continues bitwise.
TEST(CudaKvPolicies, QuestReadsTheCpusPages) {
  REQUIRE_GPU();
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  const int64_t V = model->config().vocab_size;
  const int nkv = int(model->config().num_kv_heads);
  const int layers = int(model->plan().attention_layers);
  ASSERT_GT(layers, 0);
  ThreadPool pool(2);
  // The first 200 tokens of the held-out code (model/, tokenizer and eval/
  // are all the device runs carry of coder-mini).
  std::vector<int32_t> prompt =
      Tokenizer::load(dir + "/tokenizer.json").encode(read_file(dir + "/eval/code_heldout.txt"));
  ASSERT_GE(prompt.size(), 200u);
  prompt.resize(200);
  size_t choices = 0, swaps = 0;
  for (int chunk : {-1, 0, 7}) {  // -1: the prompt token by token
    CudaOptions o;
    if (chunk > 0) o.decode.prefill_chunk = chunk;
    auto cuda = CudaModel::upload(*model, o);
    for (const QuestCase& c : quest_cases()) {
      const std::string label =
          std::string(c.name) + (chunk < 0 ? " token by token" : chunk ? " chunks of 7" : " one chunk");
      Session cpu(cpu_of(*model), c.kv, pool), gpu(gpu_view(*model, *cuda), c.kv, pool);
      // Whether every layer and KV head read the CPU's slots (a one-page
      // swap counted); other differences fail.
      auto same_pages = [&](const std::string& when) {
        bool same = true;
        for (int l = 0; l < layers; ++l)
          for (int h = 0; h < nkv; ++h) {
            const std::vector<int64_t> want = cpu.state().kv_selected(l, h), got = gpu.state().kv_selected(l, h);
            ++choices;
            if (got == want) continue;
            same = false;
            const size_t apart = pages_apart(got, want, c.kv.page);
            if (apart == 2 && got.size() == want.size()) {
              ++swaps;
              continue;
            }
            ADD_FAILURE() << label << " " << when << ", layer " << l << " KV head " << h << ": " << apart
                          << " pages apart, " << got.size() << " slots read, the CPU " << want.size();
          }
        return same;
      };
      const float tol = c.kv.dtype == KvDType::F32 ? 2e-3f : c.kv.dtype == KvDType::FP8 ? 5e-2f : 1e-2f;
      std::vector<float> a, b;
      if (chunk < 0) {
        for (size_t i = 0; i < prompt.size(); ++i) {
          a = cpu.feed({prompt[i]});
          b = gpu.feed({prompt[i]});
          if (same_pages("prompt token " + std::to_string(i))) {
            EXPECT_LE(max_abs_diff(a.data(), b.data(), size_t(V)), tol) << label << " prompt token " << i;
          }
        }
      } else {
        a = cpu.feed(prompt);
        b = gpu.feed(prompt);
        if (same_pages("after the prompt")) {
          EXPECT_LE(max_abs_diff(a.data(), b.data(), size_t(V)), tol) << label;
        }
      }
      // The prompt outgrew the budget: the choice is a real one.
      ASSERT_LT(int64_t(gpu.state().kv_selected(0, 0).size()), int64_t(prompt.size())) << label;
      std::vector<int32_t> fed;
      SessionSnapshot mid;
      for (int step = 0; step < 24; ++step) {
        const int32_t next = int32_t(argmax(a.data(), V));
        fed.push_back(next);
        a = cpu.feed({next});
        b = gpu.feed({next});
        if (same_pages("decode step " + std::to_string(step))) {
          EXPECT_LE(max_abs_diff(a.data(), b.data(), size_t(V)), tol) << label << " step " << step;
        }
        if (step == 3) mid = gpu.snapshot();
      }
      Session r(gpu_view(*model, *cuda), c.kv, pool);
      r.restore(mid);
      std::vector<float> x;
      for (size_t i = 4; i < fed.size(); ++i) x = r.feed({fed[i]});
      EXPECT_EQ(max_abs_diff(x.data(), b.data(), size_t(V)), 0.0f) << label << " restored";
      for (int l = 0; l < layers; ++l)
        for (int h = 0; h < nkv; ++h)
          EXPECT_EQ(r.state().kv_selected(l, h), gpu.state().kv_selected(l, h)) << label << " restored";
    }
  }
  std::printf("[quest-vs-cpu] %zu choices compared, %zu one-page swaps\n", choices, swaps);
  EXPECT_LE(swaps * 100, choices) << "more near-ties than rounding explains";
}

}  // namespace cuda_kv_policies_test
