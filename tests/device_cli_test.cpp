// --device cpu|cuda|auto and FLASHMOE_DEVICE, as a user meets them. These
// run on any machine; those that need "no GPU here" skip where one is usable
// (their GPU counterparts are in cuda_device_test.cpp).
#include <gtest/gtest.h>

#include <regex>

#include "backend/cuda/cuda_model.h"
#include "core/fifo_mutex.h"
#include "test_util.h"

#include <algorithm>
#include <thread>

namespace device_cli_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

#define REQUIRE_NO_GPU()                                                          \
  do {                                                                            \
    if (CudaModel::available()) GTEST_SKIP() << "a GPU is usable here; see Cuda*"; \
  } while (0)

const std::string kModel = fixture_dir("tiny-qwen35moe") + "/model";
const std::string kGen = "generate -m " + fixture_dir("tiny-qwen35moe") + "/model --ids 1,2,3 -n 4";

// bench -d: tg measured after a prefilled context, named as llama-bench does;
// a negative depth is refused by the option check.
TEST(BenchCli, DepthMeasuresTgAtThatContext) {
  const CmdResult b = run_flashmoe("bench -m " + kModel + " --device cpu -p 0 -n 4 -d 24 -r 1");
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_NE(b.out.find("| tg4 @ d24 |"), std::string::npos) << b.out;
  const CmdResult plain = run_flashmoe("bench -m " + kModel + " --device cpu -p 0 -n 4 -r 1");
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_NE(plain.out.find("| tg4   |"), std::string::npos) << plain.out;
  const CmdResult bad = run_flashmoe("bench -m " + kModel + " --device cpu -d -3");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("depth"), std::string::npos) << bad.err;
}

// bench --batch B: B sequences decoding together; the union of the experts
// the 3 tokens picked per layer (top-4 of 16) lies between 4 and 12.
TEST(BenchCli, BatchReportsAggregateAndTheExpertUnionRoofline) {
  const CmdResult r = run_flashmoe("bench -m " + kModel + " --device cpu -p 0 -n 4 -r 1 -t 1 --batch 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("| tg4 x3 (aggregate) |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| tg4 x3 (per sequence) |"), std::string::npos) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(\+ ([0-9.]+) experts per MoE layer \(counted, of 16\))"))) << r.out;
  const double experts = std::stod(m[1].str());
  EXPECT_GE(experts, 4.0);
  EXPECT_LE(experts, 12.0);
  EXPECT_NE(r.out.find("roofline 3 x"), std::string::npos) << r.out;
}

// bench --host-copies: the copy engine's path needs a GPU's host tier of
// q4/q8 experts; the values and the single-sequence test are checked.
TEST(BenchCli, HostCopiesAreCheckedAndNeedAHostTier) {
  const std::pair<const char*, const char*> cases[] = {
      {" --device cpu -p 0 -n 2 -r 1 --host-copies 1", "no host tier of q4/q8 experts"},
      {" --device cpu -p 0 -n 2 -r 1 --host-copies off", "no host tier of q4/q8 experts"},
      {" --device cpu -p 0 -n 2 -r 1 --host-copies 5", "expected off, N or Na with N 0-4, got '5'"},
      {" --device cpu -p 0 -n 2 -r 1 --host-copies 1x", "expected off, N or Na with N 0-4, got '1x'"},
      {" --device cpu -p 0 -n 2 -r 1 --batch 2 --host-copies 1", "--host-copies is for the single-sequence"},
  };
  for (const auto& [args, want] : cases) {
    const CmdResult r = run_flashmoe("bench -m " + kModel + args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << ": " << r.err;
  }
}

TEST(DeviceCli, AutoWithoutGpuRunsOnTheCpuWithoutANote) {
  REQUIRE_NO_GPU();
  const CmdResult cpu = run_flashmoe(kGen + " --device cpu");
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  const CmdResult given = run_flashmoe(kGen + " --device auto");
  EXPECT_EQ(given.code, 0) << given.err;
  EXPECT_EQ(given.out, cpu.out);
  EXPECT_EQ(given.err, "");
  // Neither --device nor FLASHMOE_DEVICE: the default is auto.
  ScopedEnv unset("FLASHMOE_DEVICE", nullptr);
  const CmdResult dflt = run_flashmoe(kGen);
  EXPECT_EQ(dflt.code, 0) << dflt.err;
  EXPECT_EQ(dflt.out, cpu.out);
  EXPECT_EQ(dflt.err, "");
}

TEST(DeviceCli, UnknownDeviceNamesTheChoices) {
  const CmdResult r = run_flashmoe(kGen + " --device bogus");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("--device: 'bogus' is not a device (expected cpu, cuda or auto)"), std::string::npos) << r.err;
}

TEST(DeviceCli, BadEnvironmentVariableIsAnErrorNamingIt) {
  ScopedEnv bad("FLASHMOE_DEVICE", "gpu0");
  const CmdResult r = run_flashmoe(kGen);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("FLASHMOE_DEVICE: 'gpu0' is not a device (expected cpu, cuda or auto)"), std::string::npos)
      << r.err;
  // --device wins over the variable (which is then not even read).
  const CmdResult flag = run_flashmoe(kGen + " --device cpu");
  EXPECT_EQ(flag.code, 0) << flag.err;
}

// FLASHMOE_DEVICE=cpu is what the suite runs under; observable on every
// machine: the CPU expert store reports its statistics, a GPU run would
// report its tiered cache instead.
TEST(DeviceCli, EnvironmentCpuIsHonoured) {
  ScopedEnv cpu("FLASHMOE_DEVICE", "cpu");
  const CmdResult r = run_flashmoe(kGen + " --stats");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("store: "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("gpu expert cache"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("note:"), std::string::npos) << r.err;
  // A GPU-only option then contradicts the variable, and the error says where cpu came from.
  const CmdResult g = run_flashmoe(kGen + " --gpu-expert-cache 50%");
  EXPECT_EQ(g.code, 1);
  EXPECT_NE(g.err.find("--gpu-expert-cache needs --device cuda or auto (FLASHMOE_DEVICE=cpu selects the CPU)"),
            std::string::npos)
      << g.err;
}

TEST(DeviceCli, EnvironmentCudaIsAnExplicitRequest) {
  REQUIRE_NO_GPU();
  ScopedEnv cuda("FLASHMOE_DEVICE", "cuda");
  const CmdResult r = run_flashmoe(kGen);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("FLASHMOE_DEVICE=cuda: no usable GPU"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("use --device cpu"), std::string::npos) << r.err;
}

TEST(DeviceCli, HelpTellsTheTruth) {
  for (const char* cmd : {"run", "chat", "generate", "logits", "bench", "eval", "serve"}) {
    const CmdResult r = run_flashmoe(std::string(cmd) + " --help");
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_NE(r.out.find("--device cpu|cuda|auto"), std::string::npos) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find("auto (default"), std::string::npos) << cmd;
    EXPECT_NE(r.out.find("FLASHMOE_DEVICE"), std::string::npos) << cmd;
  }
}

// --gpu-expert-cache with auto where no GPU is usable: the run goes on, on
// the CPU, and one note says the option had no effect.
TEST(DeviceCli, GpuExpertCacheWithAutoAndNoGpuIsNoted) {
  REQUIRE_NO_GPU();
  const CmdResult cpu = run_flashmoe(kGen + " --device cpu");
  const CmdResult r = run_flashmoe(kGen + " --device auto --gpu-expert-cache 50%");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, cpu.out);
  EXPECT_EQ(r.err.rfind("flashmoe: note: running on the CPU: no usable GPU (", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("; --gpu-expert-cache is ignored\n"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// What the CUDA backend does not implement is refused before any GPU is
// looked for, so these hold on every machine.
TEST(DeviceCli, ExplicitCudaRefusesWhatOnlyTheCpuDoes) {
  TempDir d;
  const CmdResult h = run_flashmoe("logits -m " + kModel + " --ids 1,2 --hidden -o " + d.path + "/l.safetensors --device cuda");
  EXPECT_EQ(h.code, 1);
  EXPECT_NE(h.err.find("--hidden is only available with --device cpu"), std::string::npos) << h.err;
}

// eval and serve accept the GPU now: without one, --device cuda fails on
// the GPU itself, not with "runs on --device cpu for now".
TEST(DeviceCli, EvalAndServeTakeDeviceCuda) {
  REQUIRE_NO_GPU();
  const std::string m = source_path("models/coder-mini");
  const CmdResult e = run_flashmoe("eval -q -m " + m + " --device cuda --perplexity " + m +
                                   "/eval/code_heldout.txt --window-tokens 64 --max-windows 1");
  EXPECT_EQ(e.code, 1);
  EXPECT_NE(e.err.find("--device cuda: no usable GPU"), std::string::npos) << e.err;
  const CmdResult s = run_flashmoe("serve -m " + m + " --port 0 --device cuda");
  EXPECT_EQ(s.code, 1);
  EXPECT_NE(s.err.find("--device cuda: no usable GPU"), std::string::npos) << s.err;
}

// The lock that lets the server's slots share one GPU: mutual exclusion.
TEST(FifoMutex, ExcludesAndServesEveryone) {
  FifoMutex mu;
  int64_t counter = 0;  // plain: only the lock protects it
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        std::lock_guard<FifoMutex> g(mu);
        ++counter;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(counter, 8000);
}

}  // namespace

}  // namespace device_cli_test
