// Packed models: bf16 packing is lossless, streaming equals in memory, the
// quantised formats stay close, and MLX-layout checkpoints load directly.
#include <gtest/gtest.h>

#include <dirent.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "experts/manifest.h"
#include "experts/quantize.h"
#include "experts_test_util.h"
#include "format/checkpoint.h"
#include "mlx_checkpoint.h"
#include "model/pack_model.h"
#include "test_util.h"

namespace experts_pack_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

const char* kFixtures[] = {"tiny-qwen35moe", "tiny-qwen35moe-fused", "tiny-qwen3next"};


std::string pack(const TempDir& tmp, const std::string& model, const std::string& name, QuantKind q) {
  const std::string out = tmp / name;
  PackOptions opt;
  opt.experts = q;
  pack_model(source_path(model), out, opt);
  return out;
}

}  // namespace

TEST(ExpertsPack, Bf16PackedLogitsIdenticalToUnpacked) {
  TempDir tmp;
  for (const char* fx : kFixtures) {
    const std::string hf = std::string("tests/fixtures/") + fx + "/model";
    const auto ids = reference_ids(source_path(std::string("tests/fixtures/") + fx + "/reference.safetensors"), "ids_long", 96);
    const std::string packed = pack(tmp, hf, fx, QuantKind::None);
    const auto want = run_logits(source_path(hf), ids);
    ExpertOptions mm;
    mm.store = "mmap";
    EXPECT_EQ(run_logits(packed, ids), want) << fx << " (streaming)";
    EXPECT_EQ(run_logits(packed, ids, mm), want) << fx << " (mmap)";
  }
}

TEST(ExpertsPack, PackIsAtomicAndRefusesExistingOutput) {
  TempDir tmp;
  const std::string out = pack(tmp, "tests/fixtures/tiny-qwen35moe/model", "m", QuantKind::Q8);
  EXPECT_TRUE(is_packed_dir(out));
  // Nothing but the finished directory is left next to it.
  int entries = 0;
  if (DIR* d = ::opendir(tmp.path.c_str())) {
    while (dirent* e = ::readdir(d)) entries += std::string(e->d_name)[0] != '.';
    ::closedir(d);
  }
  EXPECT_EQ(entries, 1);
  try {
    pack(tmp, "tests/fixtures/tiny-qwen35moe/model", "m", QuantKind::Q8);
    FAIL() << "packing over an existing directory must fail";
  } catch (const flashmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("already exists"), std::string::npos) << e.what();
  }
  EXPECT_THROW(pack_model(out, tmp / "again", PackOptions{}), flashmoe::Error);  // already packed
}

TEST(ExpertsPack, StreamingWithTinyCacheMatchesInMemory) {
  TempDir tmp;
  const auto ids = reference_ids(source_path("models/coder-mini/reference.safetensors"), "ids", 64);
  const std::string packed = pack(tmp, "models/coder-mini/model", "cm", QuantKind::None);
  const auto want = run_logits(source_path("models/coder-mini/model"), ids);
  // One layer's experts are 3 MiB: 1 MiB forces evictions inside every layer.
  for (int64_t cache : {0, 1}) {
    for (CachePolicy p : {CachePolicy::Lru, CachePolicy::Lfu}) {
      ExpertOptions o;
      o.cache_mb = cache;
      o.policy = p;
      o.io_threads = 3;
      EXPECT_EQ(run_logits(packed, ids, o), want) << "cache " << cache << " MiB " << cache_policy_name(p);
    }
  }
}

TEST(ExpertsPack, QuantisedCoderMiniKlAgainstBf16) {
  TempDir tmp;
  const auto ids = reference_ids(source_path("models/coder-mini/reference.safetensors"), "ids");
  const auto ref = run_logits(source_path("models/coder-mini/model"), ids);
  const int64_t V = int64_t(ref.size() / ids.size());
  const double kl8 = mean_kl(ref, run_logits(pack(tmp, "models/coder-mini/model", "q8", QuantKind::Q8), ids), V);
  const double kl4 = mean_kl(ref, run_logits(pack(tmp, "models/coder-mini/model", "q4", QuantKind::Q4), ids), V);
  std::printf("coder-mini mean KL vs bf16 over %zu ids: q8 %.3g, q4 %.3g\n", ids.size(), kl8, kl4);
  EXPECT_LE(kl8, 1e-3);
  EXPECT_LE(kl4, 0.1);
  EXPECT_LE(kl4, 5e-2);
  EXPECT_LT(kl8, kl4);
}

// Decoding, each expert product is one token: at the AVX512-VNNI level an
// int8 product against the token quantised per group. Token by token the
// q8 / q4 models must stay as close to bf16 as whole prompts do (the
// thresholds above).
TEST(ExpertsPack, QuantisedCoderMiniDecodeKlAgainstBf16) {
  TempDir tmp;
  // Fewer tokens under the sanitizers (step by step costs ~40 ms a token there).
  const auto ids =
      reference_ids(source_path("models/coder-mini/reference.safetensors"), "ids", std::getenv("FLASHMOE_SANITIZER") ? 16 : 48);
  auto step_logits = [&](const std::string& dir) {
    auto model = QwenModel::load(dir);
    ThreadPool pool(2);
    Session s(test::cpu_of(*model), KvConfig{}, pool);
    std::vector<float> all;
    for (int32_t id : ids) {
      const std::vector<float>& l = s.feed({id});
      all.insert(all.end(), l.begin(), l.end());
    }
    return all;
  };
  const auto ref = step_logits(source_path("models/coder-mini/model"));
  const int64_t V = int64_t(ref.size() / ids.size());
  const double kl8 = mean_kl(ref, step_logits(pack(tmp, "models/coder-mini/model", "q8", QuantKind::Q8)), V);
  const double kl4 = mean_kl(ref, step_logits(pack(tmp, "models/coder-mini/model", "q4", QuantKind::Q4)), V);
  std::printf("coder-mini decode (%s) mean KL vs bf16 over %zu ids: q8 %.3g, q4 %.3g\n", cpu_level_name(cpu_level()),
              ids.size(), kl8, kl4);
  EXPECT_LE(kl8, 1e-3);
  EXPECT_LE(kl4, 5e-2);
  EXPECT_LT(kl8, kl4);
}

namespace {

bool experts_only(const std::string& n) { return n.find(".mlp.experts.") != std::string::npos; }

}  // namespace

TEST(ExpertsPack, MlxQ4CheckpointEqualsQ4PackedModel) {
  TempDir tmp;
  const std::string hf = source_path("tests/fixtures/tiny-qwen35moe/model");
  const auto ids = reference_ids(source_path("tests/fixtures/tiny-qwen35moe/reference.safetensors"), "ids_long", 64);
  write_mlx(hf, tmp / "mlx", experts_only);
  const std::string packed = pack(tmp, "tests/fixtures/tiny-qwen35moe/model", "q4", QuantKind::Q4);
  EXPECT_EQ(run_logits(tmp / "mlx", ids), run_logits(packed, ids));

}

TEST(ExpertsPack, MlxAllLinearQuantisedCoderMiniStaysClose) {
  // Every linear weight quantised, embeddings and lm_head included (as
  // mlx-community checkpoints are). On coder-mini (trained weights; the tiny
  // fixtures are random, with near-flat routers whose top-k flips under any
  // rounding) the logits must stay close to bf16.
  TempDir tmp;
  const std::string hf = source_path("models/coder-mini/model");
  const auto ids = reference_ids(source_path("models/coder-mini/reference.safetensors"), "ids", 128);
  write_mlx(hf, tmp / "mlx-all", mlx_all_linear);
  write_mlx(hf, tmp / "mlx-all8", mlx_all_linear, 8);
  const auto ref = run_logits(hf, ids);
  const double kl4 = mean_kl(ref, run_logits(tmp / "mlx-all", ids), int64_t(ref.size() / ids.size()));
  const double kl8 = mean_kl(ref, run_logits(tmp / "mlx-all8", ids), int64_t(ref.size() / ids.size()));
  std::printf("coder-mini all linear weights quantised: mean KL q8 %.3g, q4 %.3g\n", kl8, kl4);
  EXPECT_LE(kl8, 1e-3);
  EXPECT_LE(kl4, 0.1);
  // And it packs like any other checkpoint.
  EXPECT_NO_THROW(pack_model(tmp / "mlx-all", tmp / "mlx-all-packed", PackOptions{}));
}

}  // namespace experts_pack_test
