// mlx-lm's checkpoint layout (mlx-community quantisations): the same weights
// written in our naming of quantised tensors (tests/mlx_checkpoint.h) and in
// mlx-lm's (scripts/fixtures/make_mlx_fixture.py, from the public
// descriptions it names: the mlx.core.quantize docs for the affine codes,
// mlx-lm's qwen3_5 / qwen3_5_moe / qwen3_next sanitize() and switch_layers
// for the names, stacking, conv and norm forms, its utils.py for the
// per-module `quantization` entries) load to the same codes and logits.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "experts_test_util.h"
#include "format/checkpoint.h"
#include "format/config.h"
#include "mlx_checkpoint.h"
#include "model/pack_model.h"
#include "model/weights.h"

namespace mlx_layout_test {

using namespace flashmoe;
using flashmoe::test::reference_ids;
using flashmoe::test::run_logits;
using flashmoe::test::source_path;
using flashmoe::test::TempDir;
using flashmoe::test::write_mlx_modules;

namespace {

// Runs make_mlx_fixture.py; numpy comes from Debian's python3-numpy
// (scripts/install-deps.sh).
void make_mlx_fixture(const std::string& in, const std::string& out) {
  const std::string cmd = test::debian_python() + " " + source_path("scripts/fixtures/make_mlx_fixture.py") + " " + in + " " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << " failed (needs python3 and python3-numpy)";
}

bool same_bytes(const Matrix& a, const Matrix& b) {
  if (a.quant != b.quant || a.rows != b.rows || a.cols != b.cols || a.group != b.group) return false;
  if (std::memcmp(a.data, b.data, a.nbytes()) != 0) return false;
  if (!a.quantized()) return true;
  return std::memcmp(a.scales, b.scales, a.scale_bytes()) == 0 && std::memcmp(a.biases, b.biases, a.scale_bytes()) == 0;
}

void check_same_model(const std::string& fixture, const TempDir& tmp) {
  const std::string hf = source_path("tests/fixtures/" + fixture + "/model");
  write_mlx_modules(hf, tmp / "ours", test::mlx_lm_bits, 4);
  make_mlx_fixture(tmp / "ours", tmp / "mlx");
  if (::testing::Test::HasFatalFailure()) return;

  Checkpoint ours(tmp / "ours"), mlx(tmp / "mlx");
  const ModelConfig cfg = load_model_config(tmp / "mlx");
  ASSERT_TRUE(mlx.has(std::string("layers.0.mlp.switch_mlp.gate_proj.weight")));
  const ModelWeights a = load_weights(ours, cfg), b = load_weights(mlx, cfg);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  EXPECT_TRUE(same_bytes(a.embed, b.embed));
  EXPECT_TRUE(same_bytes(a.lm_head, b.lm_head));
  EXPECT_EQ(a.final_norm, b.final_norm);
  int moe = 0;
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const FfnWeights &fa = a.layers[i].ffn, &fb = b.layers[i].ffn;
    EXPECT_EQ(a.layers[i].input_norm, b.layers[i].input_norm) << "layer " << i;
    EXPECT_EQ(a.layers[i].lin.conv, b.layers[i].lin.conv) << "layer " << i;
    if (!fa.moe) continue;
    ++moe;
    // mlx-lm's 8-bit router and shared-expert gate, through the per-module override.
    EXPECT_EQ(fb.router.quant, QuantKind::Q8);
    EXPECT_EQ(fb.shared_gate.quant, QuantKind::Q8);
    EXPECT_TRUE(same_bytes(fa.router, fb.router)) << "layer " << i;
    EXPECT_TRUE(same_bytes(fa.shared_gate, fb.shared_gate)) << "layer " << i;
    ASSERT_EQ(fa.experts.size(), fb.experts.size());
    for (size_t e = 0; e < fa.experts.size(); ++e) {
      EXPECT_EQ(fb.experts[e].gate.quant, QuantKind::Q4);
      EXPECT_TRUE(same_bytes(fa.experts[e].gate, fb.experts[e].gate)) << "layer " << i << " expert " << e;
      EXPECT_TRUE(same_bytes(fa.experts[e].up, fb.experts[e].up)) << "layer " << i << " expert " << e;
      EXPECT_TRUE(same_bytes(fa.experts[e].down, fb.experts[e].down)) << "layer " << i << " expert " << e;
    }
  }
  EXPECT_GT(moe, 0);

  const auto ids = reference_ids(source_path("tests/fixtures/" + fixture + "/reference.safetensors"), "ids_long", 24);
  const auto want = run_logits(tmp / "ours", ids);
  EXPECT_EQ(run_logits(tmp / "mlx", ids), want);
  // Packing reads the stacked experts (and leaves them out of
  // model.safetensors): both namings pack to the same model.
  PackOptions q8;
  q8.experts = QuantKind::Q8;
  pack_model(tmp / "mlx", tmp / "mlx-packed", q8);
  pack_model(tmp / "ours", tmp / "ours-packed", q8);
  EXPECT_EQ(run_logits(tmp / "mlx-packed", ids), run_logits(tmp / "ours-packed", ids));
}

std::string load_error(const std::string& dir) {
  try {
    const ModelConfig cfg = load_model_config(dir);
    Checkpoint ck(dir);
    load_weights(ck, cfg);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(MlxLayout, Qwen35MoeSameCodesAndLogitsAsOurNaming) {
  TempDir tmp;
  check_same_model("tiny-qwen35moe", tmp);
}

// Qwen3-Next, then (on the same files) the quantisation flashmoe cannot run:
// one error naming the module and the value.
TEST(MlxLayout, Qwen3NextSameCodesAndLogitsAsOurNamingAndClearErrors) {
  TempDir tmp;
  check_same_model("tiny-qwen3next", tmp);
  if (HasFailure()) return;
  const std::string cfg_path = tmp / "mlx/config.json";
  const std::string cfg = read_text_file(cfg_path);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string c = cfg;
    const size_t at = c.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) c.replace(at, from.size(), to);
    test::write_file(cfg_path, c);
    return load_error(tmp / "mlx");
  };
  // The router's override says 3 bits.
  const std::string router = "\"model.layers.0.mlp.gate\": {\n      \"group_size\": 64,\n      \"bits\": ";
  std::string e = with(router + "8", router + "3");
  EXPECT_NE(e.find("'model.layers.0.mlp.gate'"), std::string::npos) << e;
  EXPECT_NE(e.find("bits 3 is not supported"), std::string::npos) << e;
  e = with("\"mode\": \"affine\"", "\"mode\": \"mxfp4\"");
  EXPECT_NE(e.find("mode \"mxfp4\" is not supported"), std::string::npos) << e;
  e = with("\"group_size\": 64,\n    \"bits\": 4", "\"group_size\": 12,\n    \"bits\": 4");
  EXPECT_NE(e.find("group_size 12 is not supported"), std::string::npos) << e;
  // A module the config leaves unquantised but stored packed.
  e = with(router + "8\n    }", "\"model.layers.0.mlp.gate\": false");
  EXPECT_NE(e.find("module 'model.layers.0.mlp.gate' is not quantised"), std::string::npos) << e;
}

}  // namespace mlx_layout_test
