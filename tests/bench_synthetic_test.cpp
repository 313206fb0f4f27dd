// Issue #25: `flashmoe bench --synthetic ... --device cpu` (a random-weight
// model of a published layer shape built in host memory) and the separate
// `bench --bandwidth` DRAM probe.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "core/dtype.h"
#include "core/error.h"
#include "kv/presets.h"
#include "model/synthetic_model.h"
#include "runtime/cpu_backend.h"
#include "test_util.h"

namespace bench_synthetic_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

// The 35B-A3B preset's layer pattern and kinds, shrunk to test size.
ModelConfig tiny_config() {
  ModelConfig c = model_preset("qwen3.5-35b-a3b");
  c.num_layers = 4;  // three linear-attention layers, then a full one
  c.layer_kinds.resize(4);
  c.layer_is_moe.resize(4);
  c.hidden_size = 64;
  c.vocab_size = 256;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 32;
  c.rotary_dim = 8;
  c.lin_num_k_heads = 2;
  c.lin_num_v_heads = 2;
  c.lin_k_dim = 16;
  c.lin_v_dim = 16;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate = 32;
  c.shared_intermediate = 32;
  return c;
}

// Bytes one decoded token reads, derived by hand from the shapes above.
int64_t expected_bytes_per_token(const ModelConfig& c, int64_t expert_matrix_bytes) {
  const int64_t H = c.hidden_size, V = c.vocab_size, bf = 2, f = 4;
  const int64_t C = 2 * 2 * 16 + 2 * 16, nv = 2, dv = 16, K = 4, hd = 32, Is = 32, E = 8, topk = 2;
  int64_t b = V * H * bf + H * f + H * bf;  // lm_head, final norm, one embedding row
  for (int i = 0; i < 4; ++i) {
    b += 2 * H * f;  // norms
    if (i == 3) b += (2 * 2 * hd + 2 * 1 * hd) * H * bf + H * 2 * hd * bf + 2 * hd * f;
    else b += (C + nv * dv + 2 * nv) * H * bf + H * nv * dv * bf + (C * K + nv + nv + dv) * f;
    b += E * H * bf + 3 * Is * H * bf + H * bf;  // router, shared expert and its gate
    b += topk * 3 * expert_matrix_bytes;
  }
  return b;
}

TEST(BenchSynthetic, CpuModelCountsWhatDecodeReadsAndDecodesDeterministically) {
  const ModelConfig c = tiny_config();
  ThreadPool pool(2);
  CpuBackend bf16(std::shared_ptr<const QwenModel>(synthetic_cpu_model(c, QuantKind::None, 0, 7, pool)));
  EXPECT_EQ(bf16.weight_bytes_per_token(), expected_bytes_per_token(c, 32 * 64 * 2));
  // q8 in groups of 32: a byte per weight, plus a bf16 scale and bias per group.
  CpuBackend q8(std::shared_ptr<const QwenModel>(synthetic_cpu_model(c, QuantKind::Q8, 32, 7, pool)));
  EXPECT_EQ(q8.weight_bytes_per_token(), expected_bytes_per_token(c, 32 * 64 + 2 * 2 * 32 * 2));

  // The q8 codes dequantise into the bf16 weights' range, +-1/sqrt(fan-in).
  const Matrix& g = q8.model().weights().layers[0].ffn.experts[3].gate;
  ASSERT_EQ(g.quant, QuantKind::Q8);
  const float lo = bf16_to_f32(g.biases[0]), hi = lo + 255 * bf16_to_f32(g.scales[0]);
  EXPECT_NEAR(lo, -0.125f, 1e-3);
  EXPECT_NEAR(hi, 0.125f, 2e-3);

  for (const CpuBackend* b : {&bf16, &q8}) {
    KvConfig kv;
    int32_t first[8], second[8];
    auto s1 = b->new_state(kv);
    b->greedy(*s1, 5, 8, first, pool);
    auto s2 = b->new_state(kv);
    b->greedy(*s2, 5, 8, second, pool);
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(first[i], second[i]);
      EXPECT_GE(first[i], 0);
      EXPECT_LT(first[i], c.vocab_size);
    }
    std::vector<float> logits(size_t(c.vocab_size));
    auto s3 = b->new_state(kv);
    const int32_t ids[3] = {1, 2, 3};
    b->forward(*s3, ids, 3, LogitsMode::Last, logits.data(), pool);
    float spread = 0;
    for (float x : logits) {
      ASSERT_TRUE(std::isfinite(x));
      spread = std::max(spread, std::fabs(x - logits[0]));
    }
    EXPECT_GT(spread, 1e-3f) << "random weights give distinct logits";
  }
}

// `--weights fp8`: every linear weight an FP8 release converts is FP8
// blocks (projections, shared and routed experts), the embedding / lm_head
// and the router bf16; `--experts fp8` converts the routed experts only.
// Both decode to finite, distinct logits, and read fewer bytes per token.
TEST(BenchSynthetic, Fp8WeightsAreFp8BlocksAndDecode) {
  const ModelConfig c = tiny_config();
  ThreadPool pool(2);
  CpuBackend bf16(std::shared_ptr<const QwenModel>(synthetic_cpu_model(c, QuantKind::None, 0, 7, pool)));
  CpuBackend all(std::shared_ptr<const QwenModel>(synthetic_cpu_model(c, QuantKind::Fp8Block, 0, 7, pool, true)));
  CpuBackend experts(std::shared_ptr<const QwenModel>(synthetic_cpu_model(c, QuantKind::Fp8Block, 0, 7, pool)));
  const LayerWeights& l = all.model().weights().layers[0];
  EXPECT_TRUE(l.lin.in_proj.stored[0].fp8());
  EXPECT_TRUE(l.lin.out_proj.fp8());
  EXPECT_TRUE(l.ffn.shared.gate.fp8());
  EXPECT_TRUE(l.ffn.experts[3].down.fp8());
  EXPECT_TRUE(all.model().weights().layers[3].attn.q_proj.fp8());
  EXPECT_FALSE(l.ffn.router.quantized());
  EXPECT_FALSE(all.model().weights().lm_head.quantized());
  EXPECT_EQ(l.ffn.experts[3].gate.group, 128);
  EXPECT_EQ(l.ffn.experts[3].gate.block_rows, 128);
  const LayerWeights& e = experts.model().weights().layers[0];
  EXPECT_TRUE(e.ffn.experts[0].up.fp8());
  EXPECT_FALSE(e.ffn.shared.gate.quantized());
  EXPECT_FALSE(e.lin.out_proj.quantized());
  EXPECT_LT(all.weight_bytes_per_token(), experts.weight_bytes_per_token());
  EXPECT_LT(experts.weight_bytes_per_token(), bf16.weight_bytes_per_token());
  for (const CpuBackend* b : {&all, &experts}) {
    std::vector<float> logits(size_t(c.vocab_size));
    auto s = b->new_state(KvConfig{});
    const int32_t ids[3] = {1, 2, 3};
    b->forward(*s, ids, 3, LogitsMode::Last, logits.data(), pool);
    float spread = 0;
    for (float x : logits) {
      ASSERT_TRUE(std::isfinite(x));
      spread = std::max(spread, std::fabs(x - logits[0]));
    }
    EXPECT_GT(spread, 1e-3f);
  }
  EXPECT_THROW(synthetic_cpu_model(c, QuantKind::Q8, 32, 7, pool, true), Error);
}

TEST(BenchSynthetic, OptionErrorsAreOneLine) {
  const std::string m = source_path("models/coder-mini");
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"bench -m " + m + " --layers 2", "--layers is for --synthetic"},
      {"bench --synthetic qwen3.5-35b-a3b --device cpu --layers 41", "--layers 41 is more than qwen3.5-35b-a3b's 40"},
      {"bench --synthetic qwen3.5-35b-a3b --device cpu --layers x", "--layers"},
      {"bench --synthetic qwen3.5-35b-a3b --device cpu --layers 1 --experts q8 --group 48", "--group 48"},
      {"bench -m " + m + " --weights fp8", "--experts, --weights and --group are for --synthetic"},
      {"bench --synthetic qwen3.5-35b-a3b --device cpu --layers 1 --weights fp16", "unknown weight format 'fp16'"},
      {"bench --synthetic qwen3.5-35b-a3b --device cpu --layers 1 --weights fp8 --experts q4",
       "--weights fp8 makes the routed experts fp8 too"},
      {"bench --synthetic qwen3.5-35b-a3b --device cpu --layers 1 --experts fp8 --group 32", "--group is for --experts q8|q4"},
      {"bench --bandwidth -m " + m, "--bandwidth is a run of its own"},
      {"bench --bandwidth --synthetic qwen3.5-35b-a3b", "--bandwidth is a run of its own"},
      {"bench", "or --bandwidth"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.args);
    const CmdResult r = run_flashmoe(k.args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_EQ(r.err.rfind("flashmoe: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(k.expect), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

TEST(BenchSynthetic, BandwidthRunReportsDramReadSpeed) {
  if (sanitizer_build()) GTEST_SKIP() << "a GiB-sized streaming read: timed in the Release build";
  const CmdResult r = run_flashmoe("bench --bandwidth -t 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("last-level cache: "), std::string::npos) << r.out;
  const size_t at = r.out.find("threads, read only): ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const double gbps = std::atof(r.out.c_str() + at + 21);
  EXPECT_GT(gbps, 0.5) << r.out;
  EXPECT_LT(gbps, 2000) << r.out;
}

}  // namespace

}  // namespace bench_synthetic_test
