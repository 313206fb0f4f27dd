// `flashmoe serve --synthetic NAME --tokenizer DIR` (issue 18: the server
// measured on a model that has no tokenizer of its own): a random-weight
// model served with a real tokenizer. The reference for its answers is the
// same synthetic model (seed 1234, as bench builds it) decoded greedily in
// this process, from the prompt the chat template renders; ids the
// tokenizer lacks are expected as "<|id_N|>", spelled out by hand here.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "core/thread_pool.h"
#include "engine/session.h"
#include "format/config.h"
#include "model/synthetic_model.h"
#include "runtime/cpu_backend.h"
#include "server_process.h"
#include "test_util.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace server_synthetic_test {

using json = nlohmann::json;
using namespace flashmoe;
using namespace flashmoe::test;
using namespace flashmoe::test::serve;

namespace {

constexpr int64_t kVocab = 8192;  // coder-mini's shape with twice its tokenizer's 4,096 ids
// Greedy tokens per request: fewer under the sanitizers, where the CPU
// decode of coder-mini's shape is several times slower.
const int kTokens = sanitizer_build() ? 8 : 24;

// coder-mini's config.json with kVocab ids, written into `dir`.
std::string write_config(const TempDir& dir) {
  json c = json::parse(read_file(source_path("models/coder-mini/model/config.json")));
  c["vocab_size"] = kVocab;
  const std::string path = dir / "config.json";
  write_file(path, c.dump(2));
  return path;
}

// The bytes the server shows for each id: the tokenizer's piece, or
// "<|id_N|>" for an id it does not have.
std::string shown(const Tokenizer& tok, int32_t id) {
  return size_t(id) < tok.vocab_size() ? tok.token_to_piece(id) : "<|id_" + std::to_string(id) + "|>";
}

struct Reference {
  std::vector<int32_t> prompt, generated;
};

// Greedy decoding of the synthetic model of `config` in this process.
Reference greedy_reference(const std::string& config, const std::string& user) {
  const Tokenizer tok = Tokenizer::load(source_path("models/coder-mini/tokenizer.json"));
  const ChatTemplate chat = ChatTemplate::load(source_path("models/coder-mini/tokenizer_config.json"));
  const json msgs = json::array({{{"role", "user"}, {"content", user}}});
  Reference r;
  r.prompt = tok.encode(chat.render(nlohmann::ordered_json::parse(msgs.dump()), true));
  ThreadPool pool(2);
  CpuBackend b(std::shared_ptr<const QwenModel>(
      synthetic_cpu_model(load_model_config(config), QuantKind::None, 64, /*seed=*/1234, pool)));
  Session s(b, KvConfig{}, pool);
  s.feed(r.prompt);
  r.generated = s.greedy(kTokens);
  return r;
}

}  // namespace

TEST(ServeSynthetic, StreamedChatEqualsGreedyDecodingOfTheSameSyntheticModel) {
  TempDir dir;
  const std::string config = write_config(dir);
  const std::string user = "Write a sorting function.";
  const Reference ref = greedy_reference(config, user);
  const Tokenizer tok = Tokenizer::load(source_path("models/coder-mini/tokenizer.json"));
  int unknown = 0;
  for (int32_t id : ref.generated) unknown += size_t(id) >= tok.vocab_size() ? 1 : 0;
  ASSERT_GT(unknown, 0) << "the reference should hold ids beyond the tokenizer's (half of the vocabulary is)";

  START_SERVER(srv,
               {"--synthetic", config, "--tokenizer", source_path("models/coder-mini"), "--device", "cpu", "-t", "2",
                "--parallel", "2"},
               kNoModel);
  EXPECT_NE(srv.log().find("flashmoe serve: synthetic " + config), std::string::npos) << srv.log();
  auto c = srv.client(false);
  json body = {{"messages", json::array({{{"role", "user"}, {"content", user}}})},
               {"max_tokens", kTokens},
               {"temperature", 0},
               {"ignore_eos", true},
               {"logprobs", true},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  // Every token's bytes from the stream's logprobs, and the text shown.
  std::vector<std::string> got;
  std::string text;
  json usage;
  std::istringstream in(r->body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    const json e = json::parse(line.substr(6));
    if (e.contains("usage") && !e["usage"].is_null()) usage = e["usage"];
    if (e["choices"].empty()) continue;
    const json& ch = e["choices"][0];
    for (const char* k : {"content", "reasoning_content"})
      if (ch["delta"].contains(k) && ch["delta"][k].is_string()) text += ch["delta"][k].get<std::string>();
    if (ch["logprobs"].is_object())
      for (const json& t : ch["logprobs"]["content"]) {
        std::string bytes;
        for (int b : t["bytes"]) bytes += char(b);
        got.push_back(bytes);
      }
  }
  EXPECT_EQ(usage["prompt_tokens"], int(ref.prompt.size()));
  EXPECT_EQ(usage["completion_tokens"], kTokens);
  std::vector<std::string> want;
  for (int32_t id : ref.generated) want.push_back(shown(tok, id));
  EXPECT_EQ(got, want);
  for (int32_t id : ref.generated) {
    if (size_t(id) >= tok.vocab_size()) {
      EXPECT_NE(text.find("<|id_" + std::to_string(id) + "|>"), std::string::npos) << text;
    }
  }

  // `generate --synthetic` decodes the same ids from the same prompt.
  std::string ids;
  for (int32_t id : ref.prompt) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  const CmdResult g =
      run_flashmoe("generate --synthetic " + config + " --device cpu -t 2 -n " + std::to_string(kTokens) + " --ids " + ids);
  ASSERT_EQ(g.code, 0) << g.err;
  std::string want_ids;
  for (int32_t id : ref.generated) want_ids += (want_ids.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(g.out, want_ids + "\n");
}

TEST(ServeSynthetic, MistakesGetOneClearError) {
  TempDir dir;
  const std::string config = write_config(dir);
  const std::string tok = source_path("models/coder-mini");
  struct Case {
    std::string args, message;
  };
  json small = json::parse(read_file(config));
  small["vocab_size"] = 512;  // fewer ids than the tokenizer's 4,096
  write_file(dir / "small.json", small.dump());
  const std::vector<Case> cases = {
      {"serve --synthetic " + config, "serve --synthetic needs --tokenizer DIR"},
      {"serve --synthetic qwen9-1t --tokenizer " + tok,
       "--synthetic: unknown model 'qwen9-1t' (expected one of qwen3.5-35b-a3b, "},
      {"serve -m " + tok + " --tokenizer " + tok, "serve: --tokenizer is for --synthetic"},
      {"serve -m " + tok + " --synthetic " + config + " --tokenizer " + tok,
       "serve: give either -m/--model or --synthetic, not both"},
      {"serve", "serve: give a model with -m/--model, or --synthetic"},
      {"serve --synthetic " + config + " --tokenizer " + dir.path, "--tokenizer " + dir.path + ": no tokenizer.json"},
      {"serve --synthetic " + (dir / "small.json") + " --tokenizer " + tok + " --device cpu",
       "has 4096 token ids, more than the vocabulary of 512 of --synthetic"},
      {"serve -m " + tok + " --layers 2", "serve: --layers is for --synthetic"},
      {"generate --synthetic qwen9-1t --ids 1", "--synthetic: unknown model 'qwen9-1t'"},
  };
  for (const Case& k : cases) {
    const CmdResult r = run_flashmoe(k.args);
    EXPECT_EQ(r.code, 1) << k.args;
    EXPECT_NE(r.err.find(k.message), std::string::npos) << k.args << "\n" << r.err;
  }
}

}  // namespace server_synthetic_test
