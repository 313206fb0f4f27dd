// --device auto on a machine with a usable GPU, and `eval` on the GPU.
// Skipped (with the reason) where no GPU is usable; the no-GPU side of auto
// is in device_cli_test.cpp, the served side in server_e2e_test.cpp
// (CudaServe).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_model.h"
#include "engine/eval.h"
#include "format/model_files.h"
#include "test_util.h"

namespace cuda_device_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

const std::string kMini = source_path("models/coder-mini/model");
const std::string kGen = "generate -m " + kMini + " --ids 1,2,3 -n 12";

// auto picks the GPU: the tiered-cache statistics (a GPU-only report) and
// bench's CUDA header show it, with no note, the same ids as the CPU; and
// auto is the default when neither --device nor FLASHMOE_DEVICE is given.
TEST(CudaAuto, PicksTheGpu) {
  REQUIRE_GPU();
  const CmdResult cpu = run_flashmoe(kGen + " --device cpu");
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  const CmdResult a = run_flashmoe(kGen + " --device auto --stats");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, cpu.out);
  EXPECT_NE(a.err.find("gpu expert cache: off"), std::string::npos) << a.err;
  EXPECT_EQ(a.err.find("note:"), std::string::npos) << a.err;
  {
    ScopedEnv unset("FLASHMOE_DEVICE", nullptr);
    const CmdResult d = run_flashmoe(kGen + " --stats");
    ASSERT_EQ(d.code, 0) << d.err;
    EXPECT_NE(d.err.find("gpu expert cache: off"), std::string::npos) << d.err;
  }
  {
    ScopedEnv env("FLASHMOE_DEVICE", "auto");
    const CmdResult b = run_flashmoe("bench -m " + kMini + " -p 16 -n 16 -r 1");
    ASSERT_EQ(b.code, 0) << b.err;
    EXPECT_NE(b.out.find("cuda graph: on"), std::string::npos) << b.out;
  }
  // --gpu-expert-cache applies when auto gets the GPU.
  const CmdResult t = run_flashmoe(kGen + " --device auto --gpu-expert-cache 25% --stats");
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_EQ(t.out, cpu.out);
  EXPECT_NE(t.err.find("choices served: vram"), std::string::npos) << t.err;
}

// A packed model (here q4 experts, streamed from disk) runs on the GPU under
// auto with no note, and gives the CPU's ids.
TEST(CudaAuto, PackedModelRunsOnTheGpu) {
  REQUIRE_GPU();
  TempDir d;
  const std::string packed = d.path + "/packed";
  const CmdResult p = run_flashmoe("pack -m " + kMini + " -o " + packed + " --experts q4 --group 32");
  ASSERT_EQ(p.code, 0) << p.err;
  const std::string gen = "generate -m " + packed + " --ids 1,2,3 -n 12";
  const CmdResult cpu = run_flashmoe(gen + " --device cpu");
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  const CmdResult a = run_flashmoe(gen + " --device auto --stats");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, cpu.out);
  EXPECT_EQ(a.err.find("note:"), std::string::npos) << a.err;
  EXPECT_NE(a.err.find("gpu expert cache: off"), std::string::npos) << a.err;
  const CmdResult c = run_flashmoe(gen + " --device cuda --gpu-expert-cache 25% --stats");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_EQ(c.out, cpu.out);
  EXPECT_NE(c.err.find("choices served: vram"), std::string::npos) << c.err;
}

// h2o runs on the GPU under auto (no note) and with --device cuda, with
// the CPU's ids; what only the CPU backend implements keeps auto on the
// CPU, with one note.
TEST(CudaAuto, H2oRunsOnTheGpuAndHiddenFallsBack) {
  REQUIRE_GPU();
  const std::string gen = "generate -m " + kMini + " --ids 1,2,3,4,5,6,7,8,9,10 -n 40 --kv-h2o 16 --kv-sinks 2";
  const CmdResult cpu = run_flashmoe(gen + " --device cpu");
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  for (const char* dev : {"auto", "cuda"}) {
    const CmdResult h = run_flashmoe(gen + " --device " + dev + " --gpu-expert-cache 50% --stats");
    ASSERT_EQ(h.code, 0) << h.err;
    EXPECT_EQ(h.out, cpu.out) << dev;
    EXPECT_EQ(h.err.find("note:"), std::string::npos) << h.err;
    EXPECT_NE(h.err.find("choices served: vram"), std::string::npos) << h.err;
  }
  TempDir d;
  const CmdResult l = run_flashmoe("logits -m " + kMini + " --ids 1,2,3 --hidden -o " + d.path + "/l.safetensors --device auto");
  ASSERT_EQ(l.code, 0) << l.err;
  EXPECT_EQ(l.err, "flashmoe: note: running on the CPU: --hidden is only available on the CPU\n");
}

// eval on the GPU gives the CPU's numbers: perplexity, mean KL against the
// f32 full cache (the reference session runs on the same device), recall
// and the KV bytes. fp32 math on both, logits within ~1e-5: perplexity
// agrees to 1e-4 relative; mean KL (0.06 for a 64-token window) to 1e-3.
TEST(CudaEval, SameNumbersAsTheCpu) {
  REQUIRE_GPU();
  const ModelFiles p = resolve_model_files(source_path("models/coder-mini"));
  auto model = QwenModel::load(p.model_dir);
  auto cuda = gpu_of(*model);
  const Tokenizer tok = Tokenizer::load(p.tokenizer_json);
  const std::vector<int32_t> ids = tokenize_file(tok, source_path("models/coder-mini/eval/code_heldout.txt"));
  ThreadPool pool(2);
  PerplexityOptions po;
  po.window_tokens = 256;
  po.max_windows = 2;
  KvConfig w64;
  w64.window = 64;
  for (const KvConfig& kv : {KvConfig{}, w64}) {
    const PerplexityResult c = eval_perplexity(cpu_of(*model), ids, kv, pool, po);
    const PerplexityResult g = eval_perplexity(*cuda, ids, kv, pool, po);
    EXPECT_NEAR(g.perplexity, c.perplexity, 1e-4 * c.perplexity) << kv.describe();
    EXPECT_NEAR(g.mean_kl, c.mean_kl, 1e-3 * c.mean_kl + 1e-9) << kv.describe();
    EXPECT_EQ(g.scored, c.scored);
    EXPECT_EQ(g.kv_bytes, c.kv_bytes) << kv.describe();
    std::printf("[cuda-eval] %s: ppl cpu %.6f gpu %.6f, kl cpu %.6g gpu %.6g\n", kv.describe().c_str(), c.perplexity,
                g.perplexity, c.mean_kl, g.mean_kl);
  }
  std::vector<RecallItem> items = load_recall_jsonl(source_path("models/coder-mini/eval/recall_dev.jsonl"));
  items.resize(4);
  const RecallResult rc = eval_recall(cpu_of(*model), tok, items, KvConfig{}, pool);
  const RecallResult rg = eval_recall(*cuda, tok, items, KvConfig{}, pool);
  EXPECT_EQ(rg.outputs, rc.outputs);
  EXPECT_EQ(rg.correct, rc.correct);
  EXPECT_EQ(rg.decode_tokens, rc.decode_tokens);
  EXPECT_EQ(rg.kv_bytes, rc.kv_bytes);
}

TEST(CudaEval, CliOnTheGpuMatchesTheCpu) {
  REQUIRE_GPU();
  const std::string m = source_path("models/coder-mini");
  const std::string args = "eval -q -m " + m + " --kv-window 64 --perplexity " + m +
                           "/eval/code_heldout.txt --window-tokens 256 --max-windows 2 --json";
  const CmdResult c = run_flashmoe(args + " --device cpu");
  const CmdResult g = run_flashmoe(args + " --device cuda");
  ASSERT_EQ(c.code, 0) << c.err;
  ASSERT_EQ(g.code, 0) << g.err;
  const nlohmann::json jc = nlohmann::json::parse(c.out), jg = nlohmann::json::parse(g.out);
  EXPECT_EQ(jc["device"], "cpu");
  EXPECT_EQ(jg["device"], "cuda");
  const double pc = jc["perplexity"].get<double>(), pg = jg["perplexity"].get<double>();
  EXPECT_NEAR(pg, pc, 1e-4 * pc);
  EXPECT_EQ(jg["kv_bytes"], jc["kv_bytes"]);
  EXPECT_EQ(jg["windows"], jc["windows"]);
}

}  // namespace

}  // namespace cuda_device_test
