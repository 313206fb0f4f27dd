// FP8 block-quantised checkpoints (Qwen's / DeepSeek's FP8 releases): the
// row kernels against a scalar decode through kv/'s E4M3 codec, and a
// fixture's FP8 checkpoint (scripts/fixtures/make_fp8_fixtures.py, numpy)
// against the same weights dequantised and stored as F32.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>

#include "core/cpu_features.h"
#include "core/fp8_rows.h"
#include "core/matrix_rows.h"
#include "experts_test_util.h"
#include "format/checkpoint.h"
#include "kv/fp8_e4m3.h"
#include "model/pack_model.h"

namespace fp8_checkpoint_test {

using namespace flashmoe;
using flashmoe::test::reference_ids;
using flashmoe::test::run_logits;
using flashmoe::test::source_path;
using flashmoe::test::TempDir;

TEST(Fp8Rows, ValueOfEveryCodeMatchesTheKvCodec) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(cpu::e4m3_value(uint8_t(c)), fp8::e4m3_decode(uint8_t(c))) << "code " << c;
  }
}

// A [rows, cols] FP8 matrix with partial edge blocks, random codes (NaN
// excluded) and scales; every CPU level's dot and dequantised row against
// double sums of the scalar decode, on the whole matrix and on a slice that
// starts inside a block row.
TEST(Fp8Rows, EveryLevelMatchesScalarDecode) {
  const int64_t R = 200, C = 176, br = 64, bc = 48;  // 4 x 4 blocks, the last ones partial
  std::mt19937 rng(7);
  std::vector<uint8_t> q(size_t(R * C));
  for (auto& b : q) {
    b = uint8_t(rng() & 0xFF);
    if ((b & 0x7F) == 0x7F) b = 0x3C;
  }
  const int64_t nbr = (R + br - 1) / br, nbc = (C + bc - 1) / bc;
  std::vector<float> scales(size_t(nbr * nbc));
  std::uniform_real_distribution<float> u(1e-3f, 2e-2f);
  for (auto& s : scales) s = u(rng);
  std::vector<float> x(static_cast<size_t>(C));
  std::normal_distribution<float> g;
  for (auto& v : x) v = g(rng);
  Matrix W;
  W.dtype = DType::U8;
  W.data = q.data();
  W.rows = R;
  W.cols = C;
  W.quant = QuantKind::Fp8Block;
  W.group = int32_t(bc);
  W.block_rows = int32_t(br);
  W.block_scales = scales.data();
  auto want = [&](int64_t r, int64_t c) {
    return double(fp8::e4m3_decode(q[size_t(r * C + c)])) * scales[size_t(r / br * nbc + c / bc)];
  };
  const Matrix S = W.slice_rows(37, 150);  // starts 37 rows into block row 0
  std::vector<float> row(static_cast<size_t>(C));
  for (CpuLevel level : {CpuLevel::Portable, CpuLevel::Avx2, CpuLevel::Avx512}) {
    if (level > cpu_level_supported()) continue;
    for (int64_t r = 0; r < R; ++r) {
      double d = 0, mag = 0;
      for (int64_t c = 0; c < C; ++c) d += want(r, c) * x[size_t(c)], mag += std::fabs(want(r, c) * x[size_t(c)]);
      ASSERT_NEAR(cpu::quant_dot_row_at(level, W, r, x.data()), d, 1e-6 * mag + 1e-7) << "level " << int(level) << " row " << r;
      cpu::quant_dequant_row_at(level, W, r, row.data());
      for (int64_t c = 0; c < C; ++c) ASSERT_EQ(double(row[size_t(c)]), double(float(want(r, c)))) << r << "," << c;
    }
    for (int64_t r = 0; r < S.rows; ++r) {
      cpu::quant_dequant_row_at(level, S, r, row.data());
      for (int64_t c = 0; c < C; ++c) ASSERT_EQ(double(row[size_t(c)]), double(float(want(37 + r, c)))) << r << "," << c;
      EXPECT_EQ(cpu::quant_dot_row_at(level, S, r, x.data()), cpu::quant_dot_row_at(level, W, 37 + r, x.data()));
    }
  }
}

namespace {

void make_fp8_fixtures(const std::string& hf, const std::string& out) {
  const std::string cmd =
      test::debian_python() + " " + source_path("scripts/fixtures/make_fp8_fixtures.py") + " " + hf + " " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << " failed (needs python3 and python3-numpy)";
}

std::string load_error(const std::string& dir) {
  try {
    QwenModel::load(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// The FP8 checkpoint computes what its dequantised weights compute: the
// kernels decode the blocks (codes and scales) exactly, so only the order of
// the sums differs.
TEST(Fp8Checkpoint, LogitsMatchTheDequantisedF32Model) {
  TempDir tmp;
  make_fp8_fixtures(source_path("tests/fixtures/tiny-qwen35moe/model"), tmp.path);
  if (HasFatalFailure()) return;
  Checkpoint ck(tmp / "fp8");
  const Matrix m = ck.matrix("layers.0.mlp.experts.0.gate_proj.weight", 64, 128);
  EXPECT_EQ(m.quant, QuantKind::Fp8Block);
  EXPECT_EQ(ck.matrix("layers.0.mlp.gate.weight", 16, 128).quant, QuantKind::None);  // modules_to_not_convert
  const auto ids = reference_ids(source_path("tests/fixtures/tiny-qwen35moe/reference.safetensors"), "ids_long",
                                 std::getenv("FLASHMOE_SANITIZER") ? 8 : 32);
  const auto want = run_logits(tmp / "dequant", ids), got = run_logits(tmp / "fp8", ids);
  ASSERT_EQ(got.size(), want.size());
  float worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  std::printf("fp8 vs dequantised f32: max |dlogit| %.3g over %zu ids\n", worst, ids.size());
  EXPECT_LE(worst, 1e-4f);
  // And the FP8 weights really are a lossy copy: the bf16 model differs.
  const auto bf16 = run_logits(source_path("tests/fixtures/tiny-qwen35moe/model"), ids);
  float moved = 0;
  for (size_t i = 0; i < got.size(); ++i) moved = std::max(moved, std::fabs(got[i] - bf16[i]));
  EXPECT_GT(moved, 1e-3f);

  // Packed with the experts kept in FP8 (codes and block scales copied as
  // stored): the same logits, from expert files.
  PackOptions po;
  po.experts = QuantKind::Fp8Block;
  pack_model(tmp / "fp8", tmp / "fp8-packed", po);
  EXPECT_NE(read_text_file(tmp / "fp8-packed/flashmoe-manifest.json").find("\"format\": \"fp8\""), std::string::npos);
  EXPECT_EQ(run_logits(tmp / "fp8-packed", ids), got);
  try {
    pack_model(tmp / "dequant", tmp / "bad-packed", po);
    ADD_FAILURE() << "packing float experts as fp8 must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--experts fp8 keeps FP8 experts as they are stored"), std::string::npos) << e.what();
  }

  // Errors name the tensor or key.
  const std::string cfg = read_text_file(tmp / "fp8/config.json");
  auto with = [&](const std::string& from, const std::string& to) {
    std::string c = cfg;
    const size_t at = c.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) c.replace(at, from.size(), to);
    test::write_file(tmp / "fp8/config.json", c);
    return load_error(tmp / "fp8");
  };
  std::string e = with("\"quant_method\": \"fp8\"", "\"quant_method\": \"awq\"");
  EXPECT_NE(e.find("quant_method 'awq' is not supported"), std::string::npos) << e;
  e = with("\"quantization_config\"", "\"no_quantization_config\"");
  EXPECT_NE(e.find("is F8_E4M3 but config.json has no 'quantization_config'"), std::string::npos) << e;
  e = with("\"weight_block_size\": [\n      128,\n      128\n    ]", "\"weight_block_size\": [\n      64,\n      128\n    ]");
  EXPECT_NE(e.find("in_proj_qkv.weight_scale_inv' has shape [2, 1], expected [4, 1] (blocks of [64, 128]"),
            std::string::npos)
      << e;
}

}  // namespace fp8_checkpoint_test
