#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <sys/wait.h>

#include "core/error.h"
#include "format/config.h"
#include "kv/memory_calc.h"
#include "kv/presets.h"

namespace kv_calc_test {

using namespace flashmoe;

namespace {

constexpr int64_t KiB = 1024, MiB = 1024 * 1024;

KvConfig dtype_cfg(KvDType t, Fp8ScaleMode m = Fp8ScaleMode::Position) {
  KvConfig c;
  c.dtype = t;
  c.fp8_scale = m;
  return c;
}

struct RunResult {
  int status;
  std::string out;
};

RunResult run_cli(const std::string& args) {
  const std::string cmd = std::string(FLASHMOE_BINARY) + " " + args + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const int st = pclose(f);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

bool has(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

const std::string kTinyConfig = std::string(FLASHMOE_SOURCE_DIR) + "/tests/fixtures/tiny-qwen35moe/model/config.json";

}  // namespace

TEST(KvCalc, Qwen35_35B) {
  const ModelConfig m = model_preset("qwen3.5-35b-a3b");
  EXPECT_EQ(m.num_full_layers(), 10);
  EXPECT_EQ(m.num_linear_layers(), 30);
  const KvMemory f32 = kv_memory(m, dtype_cfg(KvDType::F32));
  EXPECT_EQ(f32.bytes_per_position(), 40 * KiB);  // 10 x 2 x 2 x 256 x 4
  EXPECT_EQ(kv_memory(m, dtype_cfg(KvDType::BF16)).bytes_per_position(), 20 * KiB);
  const KvMemory fp8 = kv_memory(m, dtype_cfg(KvDType::FP8));
  EXPECT_EQ(fp8.data_bytes_per_position, 10 * KiB);
  EXPECT_EQ(fp8.scale_bytes_per_position, 10 * 2 * 4);
  EXPECT_EQ(kv_memory(m, dtype_cfg(KvDType::FP8, Fp8ScaleMode::Head)).scale_bytes_per_position, 10 * 2 * 2 * 4);
  EXPECT_EQ(f32.gdn_state_bytes, 60 * MiB);  // 30 x 32 x 128 x 128 x 4
  EXPECT_EQ(f32.conv_state_bytes, 30 * 8192 * 3 * 4);
  EXPECT_EQ(kv_cache_bytes(m, dtype_cfg(KvDType::F32), 4096), 160 * MiB);
  KvConfig w = dtype_cfg(KvDType::FP8);
  w.window = 4096;
  EXPECT_EQ(kv_cache_bytes(m, w, 131072), (10 * KiB + 80) * 4096);
  EXPECT_EQ(kv_cache_bytes(m, w, 1000), (10 * KiB + 80) * 1000);
}

TEST(KvCalc, OtherPresets) {
  {
    const ModelConfig m = model_preset("qwen3.5-397b-a17b");
    const KvMemory r = kv_memory(m, dtype_cfg(KvDType::F32));
    EXPECT_EQ(r.full_layers, 15);
    EXPECT_EQ(r.bytes_per_position(), 60 * KiB);  // 15 x 2 x 2 x 256 x 4: not the seed's 120
    EXPECT_EQ(r.gdn_state_bytes, 45LL * 64 * 128 * 128 * 4);
    EXPECT_EQ(r.gdn_state_bytes, 180 * MiB);
    EXPECT_EQ(r.conv_state_bytes, 45LL * (2 * 16 * 128 + 64 * 128) * 3 * 4);
  }
  {
    const KvMemory r = kv_memory(model_preset("qwen3.5-122b-a10b"), dtype_cfg(KvDType::F32));
    EXPECT_EQ(r.full_layers, 12);
    EXPECT_EQ(r.bytes_per_position(), 48 * KiB);
    EXPECT_EQ(r.gdn_state_bytes, 36LL * 64 * 128 * 128 * 4);
  }
  {
    const ModelConfig m = model_preset("qwen3-next-80b-a3b");
    EXPECT_EQ(m.family, Family::Qwen3Next);
    const KvMemory r = kv_memory(m, dtype_cfg(KvDType::F32));
    EXPECT_EQ(r.bytes_per_position(), 48 * KiB);
    EXPECT_EQ(r.gdn_state_bytes, 36LL * 32 * 128 * 128 * 4);
    EXPECT_EQ(r.conv_state_bytes, 36LL * 8192 * 3 * 4);
  }
  EXPECT_THROW(model_preset("qwen3.5-9000b"), Error);
}

// tests/fixtures/tiny-qwen35moe: 8 layers (2 full), 2 KV heads x 64, GDN nv 4,
// dk = dv = 32, nk 2, conv kernel 4.
TEST(KvCalc, TinyFixtureByHand) {
  const ModelConfig m = load_model_config(kTinyConfig);
  const KvMemory f32 = kv_memory(m, dtype_cfg(KvDType::F32));
  EXPECT_EQ(f32.full_layers, 2);
  EXPECT_EQ(f32.linear_layers, 6);
  EXPECT_EQ(f32.bytes_per_position(), 2 * 2 * 2 * 64 * 4);  // 2048
  EXPECT_EQ(kv_memory(m, dtype_cfg(KvDType::F16)).bytes_per_position(), 1024);
  const KvMemory fp8 = kv_memory(m, dtype_cfg(KvDType::FP8));
  EXPECT_EQ(fp8.bytes_per_position(), 512 + 2 * 2 * 4);
  EXPECT_EQ(kv_memory(m, dtype_cfg(KvDType::FP8, Fp8ScaleMode::Head)).bytes_per_position(), 512 + 2 * 2 * 2 * 4);
  EXPECT_EQ(f32.gdn_state_bytes, 6 * 4 * 32 * 32 * 4);           // 98304
  EXPECT_EQ(f32.conv_state_bytes, 6 * (2 * 2 * 32 + 4 * 32) * 3 * 4);  // 18432
  KvConfig h = dtype_cfg(KvDType::BF16);
  h.h2o_budget = 100;
  EXPECT_EQ(kv_cache_bytes(m, h, 4096), 1024 * 100);
  EXPECT_EQ(kv_cache_bytes(m, h, 50), 1024 * 50);
}

TEST(KvCalc, FormatAndContextList) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(40 * KiB), "40.00 KiB");
  EXPECT_EQ(format_bytes(10320), "10.08 KiB");
  EXPECT_EQ(format_bytes(60 * MiB), "60.00 MiB");
  EXPECT_EQ(format_bytes(5 * 1024 * MiB), "5.00 GiB");
  EXPECT_EQ(parse_context_list("4096,32768, 128k,1M"), (std::vector<int64_t>{4096, 32768, 131072, 1048576}));
  EXPECT_THROW(parse_context_list("4096,,8"), Error);
  EXPECT_THROW(parse_context_list("-5"), Error);
  EXPECT_THROW(parse_context_list("abc"), Error);
}

TEST(KvCalcCli, Preset35BPrintsThePinnedNumbers) {
  const RunResult f32 = run_cli("kv-calc --preset qwen3.5-35b-a3b");
  ASSERT_EQ(f32.status, 0) << f32.out;
  EXPECT_TRUE(has(f32.out, "KV per position: 40960 B (40.00 KiB)")) << f32.out;
  EXPECT_TRUE(has(f32.out, "60.00 MiB recurrent")) << f32.out;
  EXPECT_TRUE(has(f32.out, "160.00 MiB")) << f32.out;  // 4096 positions in f32
  // The comparison table lists f32, bf16 and fp8 per position.
  EXPECT_TRUE(has(f32.out, "20.00 KiB")) << f32.out;
  EXPECT_TRUE(has(f32.out, "10.08 KiB")) << f32.out;

  const RunResult fp8 = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-dtype fp8 --context 4096,64k");
  ASSERT_EQ(fp8.status, 0) << fp8.out;
  EXPECT_TRUE(has(fp8.out, "KV per position: 10320 B (10.08 KiB) = 10240 B K/V data (10.00 KiB) + 80 B fp8 scales"))
      << fp8.out;
  EXPECT_TRUE(has(fp8.out, "65536")) << fp8.out;

  const RunResult w = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-dtype fp8 --kv-window 4096 --context 131072");
  ASSERT_EQ(w.status, 0) << w.out;
  EXPECT_TRUE(has(w.out, "40.31 MiB")) << w.out;  // capped at 4096 positions
}

TEST(KvCalcCli, ReadsConfigJsonOrDirectory) {
  for (const std::string& path : {kTinyConfig, std::string(FLASHMOE_SOURCE_DIR) + "/tests/fixtures/tiny-qwen35moe/model"}) {
    const RunResult r = run_cli("kv-calc -m " + path + " --kv-h2o 64 --kv-sinks 2 --kv-recent 0.5");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_TRUE(has(r.out, "KV per position: 2048 B (2.00 KiB)")) << r.out;
    EXPECT_TRUE(has(r.out, "96.00 KiB recurrent")) << r.out;
    EXPECT_TRUE(has(r.out, "h2o 64 (sinks 2, recent 32)")) << r.out;
    const RunResult t = run_cli("kv-calc -m " + path + " --kv-tova 64 --kv-sinks 0 --context 2048");
    ASSERT_EQ(t.status, 0) << t.out;
    EXPECT_TRUE(has(t.out, "tova 64 (sinks 0, recent 1)")) << t.out;
    EXPECT_TRUE(has(t.out, "128.00 KiB")) << t.out;  // 64 positions x 2 KiB
  }
}

TEST(KvCalcCli, BadOptionsGiveClearErrors) {
  RunResult r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-dtype fp4");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "accepts f32, bf16, f16, fp8")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-fp8-scale head");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "--kv-fp8-scale needs --kv-dtype fp8")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-h2o 3");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "at least sinks + 1")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-streaming 4 --kv-sinks 4");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "too small")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-h2o 64 --kv-recent 2");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "--kv-recent must be a fraction")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-tova 64 --kv-h2o 64");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "--kv-h2o and --kv-tova are exclusive")) << r.out;
  r = run_cli("kv-calc --preset nope");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "qwen3.5-35b-a3b")) << r.out;
  r = run_cli("kv-calc");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "exactly one of -m")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-streaming 1024 --kv-dtype bf16");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "streaming 1024 (sinks 4)")) << r.out;
}

// The fp8 transforms run on the CPU and kv-calc names them; with --device
// cuda `rotated` runs (tests/cuda_test.cpp's kv_cases) and `channel` is
// refused by name, before any upload (the CUDA kernels read keys without
// offsets).
class KvFp8TransformCli : public ::testing::TestWithParam<const char*> {};

TEST_P(KvFp8TransformCli, RunsOnTheCpuAndChannelIsRefusedOnCuda) {
  const std::string mode = GetParam();
  const std::string m = std::string(FLASHMOE_SOURCE_DIR) + "/tests/fixtures/tiny-qwen35moe/model";
  const std::string o = ::testing::TempDir() + "kv_fp8_" + mode + "_logits.safetensors";
  const std::string kv = " --kv-dtype fp8 --kv-fp8-scale " + mode;
  RunResult r = run_cli("logits -m " + m + " --device cpu" + kv + " --ids 1,2,3 -o " + o);
  EXPECT_EQ(r.status, 0) << r.out;
  std::remove(o.c_str());
  r = run_cli("logits -m " + m + " --device cuda" + kv + " --ids 1,2,3 -o " + o);
  std::remove(o.c_str());
  const bool refused = has(r.out, "--kv-fp8-scale " + mode + " is only available with --device cpu");
  EXPECT_EQ(refused, mode == "channel") << r.out;
  if (refused) {
    EXPECT_NE(r.status, 0);
  }
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b" + kv);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "fp8/" + mode)) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Modes, KvFp8TransformCli, ::testing::Values("rotated", "channel"));

// The Quest store and SnapKV run through the CPU model (a 40-token prompt
// over pages of 8 with 16 resident; SnapKV with a prompt longer than its
// budget, then decoding). Both run on the GPU too:
// tests/cuda_kv_policies_test.cpp.
TEST(KvQuestSnapKvCli, RunOnTheCpu) {
  const std::string m = std::string(FLASHMOE_SOURCE_DIR) + "/tests/fixtures/tiny-qwen35moe/model";
  const std::string o = ::testing::TempDir() + "kv_quest_logits.safetensors";
  std::string ids = "1";
  for (int i = 2; i <= 40; ++i) ids += "," + std::to_string(i);
  RunResult r = run_cli("logits -m " + m + " --device cpu --kv-dtype fp8 --kv-resident 16 --kv-page 8 --ids " + ids +
                        " -o " + o);
  EXPECT_EQ(r.status, 0) << r.out;
  std::remove(o.c_str());
  r = run_cli("generate -m " + m + " --device cpu --kv-snapkv 16 --ids " + ids + " -n 4 --greedy");
  EXPECT_EQ(r.status, 0) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-dtype fp8 --kv-resident 256 --kv-page 16 --context 4096");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "256 resident per query, pages of 16")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-resident 256 --kv-window 64");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "--kv-resident is exclusive with --kv-window")) << r.out;
}

}  // namespace kv_calc_test
