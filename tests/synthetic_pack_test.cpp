// pack --synthetic: a packed model of a given shape with random weights,
// written record by record; it loads, streams and runs like a packed checkpoint.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>

#include "engine/session.h"
#include "experts/expert_layout.h"
#include "experts/manifest.h"
#include "format/config.h"
#include "kv/presets.h"
#include "model/synthetic_pack.h"
#include "test_util.h"

namespace synthetic_pack_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

uint64_t file_size(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 ? uint64_t(st.st_size) : 0;
}

// The 397B expert in q4, group 64, by hand: gate and up are [1024, 4096],
// down [4096, 1024]; each matrix is 4096 * 1024 / 2 bytes of codes plus a
// bf16 scale and bias per 64 weights (2 * 2 * 4096 * 1024 / 64 bytes), every
// part 64-byte aligned already: 3 * (2 MiB + 256 KiB) = 6.75 MiB.
TEST(SyntheticPack, The397bExpertRecordIs6Point75MiBInQ4) {
  const ModelConfig c = model_preset("qwen3.5-397b-a17b");
  EXPECT_EQ(ExpertLayout::make(c.hidden_size, c.moe_intermediate, QuantKind::Q4, 64).bytes, 3u * (2097152u + 262144u));
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
}

TEST(SyntheticPack, ConfigJsonReadsBackAsTheSameShape) {
  ModelConfig c = model_preset("qwen3.5-397b-a17b");
  c.num_layers = 5;
  c.layer_kinds.resize(5);
  c.layer_is_moe.resize(5);
  const ModelConfig r = parse_model_config(synthetic_config_json(c), "synthetic");
  EXPECT_EQ(r.hidden_size, c.hidden_size);
  EXPECT_EQ(r.num_layers, 5);
  EXPECT_EQ(r.layer_kinds, c.layer_kinds);
  EXPECT_EQ(r.layer_is_moe, c.layer_is_moe);
  EXPECT_EQ(r.num_experts, c.num_experts);
  EXPECT_EQ(r.num_experts_per_tok, c.num_experts_per_tok);
  EXPECT_EQ(r.moe_intermediate, c.moe_intermediate);
  EXPECT_EQ(r.shared_intermediate, c.shared_intermediate);
  EXPECT_EQ(r.num_heads, c.num_heads);
  EXPECT_EQ(r.num_kv_heads, c.num_kv_heads);
  EXPECT_EQ(r.head_dim, c.head_dim);
  EXPECT_EQ(r.rotary_dim, c.rotary_dim);
  EXPECT_EQ(r.lin_conv_dim(), c.lin_conv_dim());
  EXPECT_EQ(r.vocab_size, c.vocab_size);
  EXPECT_TRUE(r.tie_word_embeddings);
}

// The tiny fixture's shape (16 experts of 128 x 64), q4: what is written is
// the byte count promised, the manifest checks out, and the model streams
// through a 4-token decode with finite logits and the reads counted.
TEST(SyntheticPack, SmallShapeLoadsAndStreams) {
  ModelConfig c = load_model_config(fixture_dir("tiny-qwen35moe") + "/model");
  TempDir tmp;
  const std::string out = tmp.path + "/synth";
  PackOptions po;
  po.experts = QuantKind::Q4;
  po.group = 32;
  pack_synthetic(c, out, po);
  const ModelConfig r = load_model_config(out);
  const PackedManifest m = read_manifest(out, r);
  ASSERT_EQ(int64_t(m.layers.size()), c.num_layers);
  uint64_t written = file_size(out + "/model.safetensors");
  for (const PackedLayer& l : m.layers) written += file_size(out + "/" + l.file);
  // The safetensors header is the only thing the count leaves out.
  EXPECT_GE(written, synthetic_pack_bytes(c, po));
  EXPECT_LE(written, synthetic_pack_bytes(c, po) + 64 * 1024);
  EXPECT_THROW(pack_synthetic(c, out, po), Error);  // exists

  ExpertOptions eo;
  eo.store = "stream";
  eo.cache_mb = 0;
  auto model = QwenModel::load(out, eo);
  ThreadPool pool(2);
  Session s(cpu_of(*model), KvConfig{}, pool);
  const std::vector<float> l = s.feed_all({1, 2, 3, 4});
  for (float v : l) ASSERT_TRUE(std::isfinite(v));
  const ExpertStats st = model->expert_store().stats();
  EXPECT_GT(st.misses, 0u);
  EXPECT_EQ(st.bytes_read, st.misses * m.layout.bytes);
  EXPECT_GT(st.read_s, 0.0);
}

TEST(SyntheticPack, CliErrorsNameWhatIsWrong) {
  TempDir tmp;
  const std::string out = " -o " + tmp.path + "/x";
  CmdResult r = run_flashmoe("pack" + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("give a model with -m/--model, or --synthetic PRESET"), std::string::npos) << r.err;
  r = run_flashmoe("pack --synthetic qwen3-next-80b-a3b --experts q4" + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("is not a Qwen3.5 size"), std::string::npos) << r.err;
  r = run_flashmoe("pack --synthetic qwen3.5-397b-a17b --layers 61 --experts q4" + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--layers 61 is more than qwen3.5-397b-a17b's 60 layers"), std::string::npos) << r.err;
  r = run_flashmoe("pack -m " + fixture_dir("tiny-qwen35moe") + "/model --layers 2" + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--layers is for --synthetic"), std::string::npos) << r.err;
  r = run_flashmoe("pack --synthetic qwen3.5-397b-a17b --experts fp8 --layers 1" + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("pick bf16, q8 or q4"), std::string::npos) << r.err;
}

}  // namespace

}  // namespace synthetic_pack_test
