// Every failure a user can cause gives one clear message and a non-zero exit.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/cpu_features.h"
#include "format/safetensors.h"
#include "test_util.h"

namespace cli_errors_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

const std::string kFixture = "tiny-qwen35moe-text";

// A copy of the fixture's model directory whose safetensors file is rewritten
// by `edit` (which may drop, reshape or retype tensors).
struct ModelCopy {
  TempDir tmp;
  std::string dir() const { return tmp.path; }
  ModelCopy() { copy_file(fixture_dir(kFixture) + "/model/config.json", tmp.path + "/config.json"); }
  void copy_weights() {
    copy_file(fixture_dir(kFixture) + "/model/model.safetensors", tmp.path + "/model.safetensors");
  }
  template <class Edit>
  void rewrite_weights(Edit edit) {
    SafetensorsFile src(fixture_dir(kFixture) + "/model/model.safetensors");
    std::vector<TensorView> views;
    for (const auto& n : src.names()) views.push_back(src.get(n));
    std::vector<TensorToWrite> out;
    for (auto& v : views) {
      TensorToWrite t{v.name, v.dtype, v.shape, v.data};
      if (edit(t)) out.push_back(t);
    }
    write_safetensors(tmp.path + "/model.safetensors", out);
  }
};

CmdResult logits_on(const std::string& dir, const std::string& ids = "1,2,3") {
  TempDir out;
  return run_flashmoe("logits -m " + dir + " --ids " + ids + " -o " + out.path + "/l.safetensors");
}

void expect_error(const CmdResult& r, const std::string& needle) {
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr was: " << r.err;
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
}

TEST(CliErrors, MissingDirectory) {
  expect_error(logits_on("/nonexistent/model-dir"), "/nonexistent/model-dir");
}

TEST(CliErrors, MissingConfig) {
  TempDir d;
  expect_error(logits_on(d.path), "config.json");
}

TEST(CliErrors, UnknownModelType) {
  ModelCopy m;
  m.copy_weights();
  write_file(m.dir() + "/config.json", R"({"model_type": "llama", "hidden_size": 8})");
  expect_error(logits_on(m.dir()), "unsupported model_type 'llama'");
}

TEST(CliErrors, ConfigNotJson) {
  ModelCopy m;
  m.copy_weights();
  write_file(m.dir() + "/config.json", "{ not json");
  expect_error(logits_on(m.dir()), "not valid JSON");
}

TEST(CliErrors, TruncatedSafetensors) {
  ModelCopy m;
  std::string data = read_file(fixture_dir(kFixture) + "/model/model.safetensors");
  write_file(m.dir() + "/model.safetensors", data.substr(0, data.size() / 2));
  expect_error(logits_on(m.dir()), "point outside the file");
}

TEST(CliErrors, HeaderLongerThanFile) {
  ModelCopy m;
  std::string data = read_file(fixture_dir(kFixture) + "/model/model.safetensors");
  write_file(m.dir() + "/model.safetensors", data.substr(0, 100));
  expect_error(logits_on(m.dir()), "header length");
}

TEST(CliErrors, HeaderPointsOutsideFile) {
  ModelCopy m;
  std::string header = R"({"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,1000000]}})";
  std::string data(8, '\0');
  for (int i = 0; i < 8; ++i) data[i] = char((header.size() >> (8 * i)) & 0xff);
  write_file(m.dir() + "/model.safetensors", data + header + std::string(16, '\0'));
  expect_error(logits_on(m.dir()), "outside the file");
}

TEST(CliErrors, MissingTensor) {
  ModelCopy m;
  m.rewrite_weights([](TensorToWrite& t) { return t.name != "model.layers.1.linear_attn.dt_bias"; });
  expect_error(logits_on(m.dir()), "model.layers.1.linear_attn.dt_bias");
}

TEST(CliErrors, WrongShape) {
  ModelCopy m;
  std::vector<float> small(127, 0.0f);
  m.rewrite_weights([&](TensorToWrite& t) {
    if (t.name == "model.norm.weight") {
      t.dtype = DType::F32;
      t.shape = {127};
      t.data = small.data();
    }
    return true;
  });
  CmdResult r = logits_on(m.dir());
  expect_error(r, "model.norm.weight");
  expect_error(r, "[127]");
}

TEST(CliErrors, UnsupportedDtype) {
  ModelCopy m;
  std::vector<double> wide(128, 0.0);
  m.rewrite_weights([&](TensorToWrite& t) {
    if (t.name == "model.norm.weight") {
      t.dtype = DType::I64;  // stands in for any dtype flashmoe cannot read as weights
      t.data = wide.data();
    }
    return true;
  });
  CmdResult r = logits_on(m.dir());
  expect_error(r, "model.norm.weight");
  expect_error(r, "dtype I64");
  // A dtype safetensors defines but flashmoe does not read at all (F64):
  // same element size as I64, so only the header's dtype string changes.
  std::string data = read_file(m.dir() + "/model.safetensors");
  size_t at = data.find("\"I64\"");
  ASSERT_NE(at, std::string::npos);
  data.replace(at, 5, "\"F64\"");
  write_file(m.dir() + "/model.safetensors", data);
  CmdResult r2 = logits_on(m.dir());
  expect_error(r2, "model.norm.weight");
  expect_error(r2, "dtype F64");
}

// A config.json that disagrees with the tensors: each lie is caught at load
// with a message naming the tensor (or the field), never a crash or garbage
// output. The fixture: 4 layers (3 linear + 1 full), hidden 128, vocab 512,
// 4 heads x 64 (2 KV heads), 16 experts x 64, shared expert 96, tied embeddings.
struct ConfigLie {
  const char* what;
  std::function<void(nlohmann::json&)> edit;
  std::vector<std::string> needles;
};

void expect_lies_refused(const std::vector<ConfigLie>& lies) {
  for (const auto& lie : lies) {
    SCOPED_TRACE(lie.what);
    ModelCopy m;
    m.copy_weights();
    nlohmann::json j = nlohmann::json::parse(read_file(m.dir() + "/config.json"));
    lie.edit(j);
    write_file(m.dir() + "/config.json", j.dump());
    TempDir out;
    CmdResult r = run_flashmoe("logits -m " + m.dir() + " --ids 1,2,3 -o " + out.path + "/l.safetensors");
    EXPECT_EQ(r.code, 1) << r.err;
    for (const auto& n : lie.needles) expect_error(r, n);
    EXPECT_FALSE(std::filesystem::exists(out.path + "/l.safetensors"));
  }
}

TEST(CliErrors, ConfigThatLiesAboutShapes) {
  expect_lies_refused({
      {"hidden_size", [](auto& j) { j["hidden_size"] = 96; }, {"model.embed_tokens.weight", "[512, 96]", "from config.json"}},
      {"vocab_size", [](auto& j) { j["vocab_size"] = 1024; }, {"model.embed_tokens.weight", "[1024, 128]"}},
      {"num_experts", [](auto& j) { j["num_experts"] = 8; }, {"model.layers.0.mlp.gate.weight", "[8, 128]"}},
      {"moe_intermediate_size", [](auto& j) { j["moe_intermediate_size"] = 32; }, {"model.layers.0.mlp.experts.", "from config.json"}},
      {"num_attention_heads", [](auto& j) { j["num_attention_heads"] = 8; }, {"model.layers.3.self_attn.q_proj.weight"}},
      {"head_dim", [](auto& j) { j["head_dim"] = 32; }, {"model.layers.3.self_attn.q_proj.weight"}},
      {"heads x head_dim kept", [](auto& j) { j["num_attention_heads"] = 8, j["num_key_value_heads"] = 4, j["head_dim"] = 32; },
       {"model.layers.3.self_attn.q_norm.weight", "[32]"}},
      {"num_key_value_heads", [](auto& j) { j["num_key_value_heads"] = 4; }, {"model.layers.3.self_attn.k_proj.weight"}},
      {"linear_num_value_heads", [](auto& j) { j["linear_num_value_heads"] = 8; }, {"model.layers.0.linear_attn.in_proj_qkv.weight"}},
      {"linear_conv_kernel_dim", [](auto& j) { j["linear_conv_kernel_dim"] = 3; }, {"model.layers.0.linear_attn.conv1d.weight"}},
      {"shared_expert_intermediate_size", [](auto& j) { j["shared_expert_intermediate_size"] = 48; },
       {"model.layers.0.mlp.shared_expert.gate_proj.weight"}},
  });
}

// Lies about which weights exist (layers, layer kinds, shared expert, lm_head).
TEST(CliErrors, ConfigThatLiesAboutLayers) {
  expect_lies_refused({
      {"no shared expert", [](auto& j) { j.erase("shared_expert_intermediate_size"); },
       {"model.layers.0.mlp.shared_expert", "is not used", "no shared_expert_intermediate_size"}},
      {"fewer layers", [](auto& j) { j["num_hidden_layers"] = 3, j.erase("layer_types"); },
       {"model.layers.3.", "is not used", "has layer 3 but config.json says num_hidden_layers 3"}},
      {"more layers", [](auto& j) { j["num_hidden_layers"] = 5, j.erase("layer_types"); }, {"model.layers.4.", "which config.json implies"}},
      {"layer_types", [](auto& j) { j["layer_types"][0] = "full_attention"; }, {"model.layers.0.self_attn.q_proj.weight", "which config.json implies"}},
      {"mlp_only_layers", [](auto& j) { j["mlp_only_layers"] = {0}, j["intermediate_size"] = 64; },
       {"model.layers.0.mlp.gate_proj.weight"}},
      {"tie_word_embeddings", [](auto& j) { j["tie_word_embeddings"] = false; }, {"lm_head.weight", "tie_word_embeddings"}},
  });
}

// A packed model whose config.json no longer matches its expert files.
TEST(CliErrors, PackedConfigThatLiesAboutExperts) {
  TempDir t;
  const std::string packed = t.path + "/p";
  ASSERT_EQ(run_flashmoe("pack -m " + fixture_dir(kFixture) + "/model -o " + packed).code, 0);
  const std::string cfg = read_file(packed + "/config.json");
  nlohmann::json j = nlohmann::json::parse(cfg);
  j["moe_intermediate_size"] = 32;
  write_file(packed + "/config.json", j.dump());
  expect_error(run_flashmoe("generate -m " + packed + " --ids 1,2,3 -n 2 --greedy"), "expert layout is inconsistent");
  j = nlohmann::json::parse(cfg);
  j["num_hidden_layers"] = 3;
  j.erase("layer_types");
  write_file(packed + "/config.json", j.dump());
  expect_error(run_flashmoe("generate -m " + packed + " --ids 1,2,3 -n 2 --greedy"), "num_hidden_layers 3");
}

TEST(CliErrors, IdsOutOfVocabulary) {
  CmdResult r = logits_on(fixture_dir(kFixture) + "/model", "1,2,512");
  expect_error(r, "token id 512 is out of range");
  expect_error(run_flashmoe("generate -m " + fixture_dir(kFixture) + "/model --ids -1 -n 2 --greedy"), "token id -1");
}

TEST(CliErrors, MalformedIds) {
  expect_error(logits_on(fixture_dir(kFixture) + "/model", "1,x,3"), "'x' is not a token id");
}

TEST(CliErrors, UnknownFlag) {
  CmdResult r = run_flashmoe("logits -m x --ids 1 -o y --no-such-flag");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("no-such-flag"), std::string::npos) << r.err;
}

TEST(Cli, LogitsCommandWritesReferenceLogits) {
  const std::string ref = fixture_dir(kFixture) + "/reference.safetensors";
  RefTensor ids = load_ref(ref, "ids_short"), logits = load_ref(ref, "logits_short");
  TempDir out;
  CmdResult r = run_flashmoe("logits -m " + fixture_dir(kFixture) + "/model -t 1 --ids " + join_ids(ids.ids) +
                             " -o " + out.path + "/l.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  RefTensor got = load_ref(out.path + "/l.safetensors", "logits");
  ASSERT_EQ(got.shape, logits.shape);
  EXPECT_LE(max_abs_diff(got.f32.data(), logits.f32.data(), got.f32.size()), 1e-3f);
}

// Every narrower kernel level (FLASHMOE_CPU_LEVEL) this CPU can run must
// compute the same function as the default (widest) one, end to end.
TEST(Cli, EveryCpuLevelMatchesReference) {
  const std::string dir = fixture_dir("tiny-qwen3next");
  RefTensor ids = load_ref(dir + "/reference.safetensors", "ids_long");
  RefTensor logits = load_ref(dir + "/reference.safetensors", "logits_long");
  RefTensor ref8 = load_ref(dir + "/reference.safetensors", "logits_long_fp8");
  // Under the sanitizers, the first 100 of the 300 tokens (the logits of a
  // prefix are the prefix of the logits): every kernel set still runs.
  if (sanitizer_build()) ids.ids.resize(100);
  const size_t n = logits.f32.size() / size_t(logits.shape[0]) * ids.ids.size();
  TempDir out;
  CmdResult r = run_flashmoe("logits -m " + dir + "/model --kv-dtype fp8 --ids " + join_ids(ids.ids) + " -o " +
                             out.path + "/l.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  RefTensor fast = load_ref(out.path + "/l.safetensors", "logits");
  // FP8 storage amplifies last-bit differences between the kernel sets (a
  // flipped E4M3 rounding), so judge it as the FP8 golden tests do.
  EXPECT_LE(mean_abs_diff(fast.f32.data(), ref8.f32.data(), n),
            0.1f * mean_abs_diff(logits.f32.data(), ref8.f32.data(), n));
  std::vector<std::string> levels = {"portable"};
  if (cpu_level_supported() >= CpuLevel::Avx2) levels.push_back("avx2");
  for (const std::string& level : levels) {
    SCOPED_TRACE(level);
    setenv("FLASHMOE_CPU_LEVEL", level.c_str(), 1);
    r = run_flashmoe("logits -m " + dir + "/model --ids " + join_ids(ids.ids) + " -o " + out.path + "/p.safetensors");
    CmdResult r8 = run_flashmoe("logits -m " + dir + "/model --kv-dtype fp8 --ids " + join_ids(ids.ids) + " -o " +
                                out.path + "/p8.safetensors");
    unsetenv("FLASHMOE_CPU_LEVEL");
    ASSERT_EQ(r.code, 0) << r.err;
    ASSERT_EQ(r8.code, 0) << r8.err;
    RefTensor narrow = load_ref(out.path + "/p.safetensors", "logits");
    EXPECT_LE(max_abs_diff(narrow.f32.data(), logits.f32.data(), n), 1e-3f);
    RefTensor narrow8 = load_ref(out.path + "/p8.safetensors", "logits");
    EXPECT_LE(mean_abs_diff(narrow8.f32.data(), ref8.f32.data(), n),
              0.1f * mean_abs_diff(logits.f32.data(), ref8.f32.data(), n));
  }
}

TEST(Cli, BadCpuLevelIsOneErrorNamingTheVariable) {
  const std::string dir = fixture_dir("tiny-qwen3next");
  setenv("FLASHMOE_CPU_LEVEL", "sse9", 1);
  CmdResult r = run_flashmoe("logits -m " + dir + "/model --ids 1,2 -o /dev/null");
  unsetenv("FLASHMOE_CPU_LEVEL");
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err, "flashmoe: error: FLASHMOE_CPU_LEVEL='sse9' is not one of portable, avx2, avx512, avx512vnni\n");
  if (cpu_level_supported() < CpuLevel::Avx512) {
    setenv("FLASHMOE_CPU_LEVEL", "avx512", 1);
    r = run_flashmoe("logits -m " + dir + "/model --ids 1,2 -o /dev/null");
    unsetenv("FLASHMOE_CPU_LEVEL");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find("FLASHMOE_CPU_LEVEL=avx512 but this CPU supports at most"), std::string::npos) << r.err;
  }
}

TEST(Cli, GeneratePrintsGreedyIds) {
  const std::string ref = fixture_dir("tiny-qwen3next-sharded") + "/reference.safetensors";
  RefTensor prompt = load_ref(ref, "prompt"), greedy = load_ref(ref, "greedy");
  CmdResult r = run_flashmoe("generate -m " + fixture_dir("tiny-qwen3next-sharded") + "/model --ids " +
                             join_ids(prompt.ids) + " -n " + std::to_string(greedy.ids.size()) +
                             " --greedy --print-ids");
  ASSERT_EQ(r.code, 0) << r.err;
  std::string expect;
  for (size_t i = 0; i < greedy.ids.size(); ++i) {
    if (i) expect += ' ';
    expect += std::to_string(greedy.ids[i]);
  }
  EXPECT_EQ(r.out, expect + "\n");
}

}  // namespace

}  // namespace cli_errors_test
