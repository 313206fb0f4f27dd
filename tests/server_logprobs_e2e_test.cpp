// Log-probabilities from the server against an independent computation: the
// log-softmax (in double) of the logits that `flashmoe logits` writes for
// the same token sequence (the prompt plus the tokens generated before each
// position), for /v1/completions and a streamed /v1/chat/completions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "server_process.h"
#include "test_util.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace server_logprobs_e2e_test {

using json = nlohmann::json;
using namespace flashmoe;
using namespace flashmoe::test;
using namespace flashmoe::test::serve;

namespace {

struct Expected {
  std::vector<double> logprob;             // of the token at each generated position
  std::vector<std::vector<double>> top;    // the largest log-probabilities there, descending
};

// Runs `flashmoe logits` on prompt + generated and log-softmaxes the rows
// that predicted each generated token.
Expected reference(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated, size_t k) {
  std::vector<int32_t> ids = prompt;
  ids.insert(ids.end(), generated.begin(), generated.end());
  TempDir dir;
  const std::string out = dir.path + "/logits.safetensors";
  CmdResult r = run_flashmoe("logits -m " + source_path("models/coder-mini") + " -t 2 --ids " + join_ids(ids) + " -o " + out);
  EXPECT_EQ(r.code, 0) << r.err;
  RefTensor t = load_ref(out, "logits");
  const int64_t V = t.shape[1];
  Expected e;
  for (size_t g = 0; g < generated.size(); ++g) {
    const float* row = t.f32.data() + (prompt.size() - 1 + g) * size_t(V);
    double mx = row[0];
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
    const double lse = mx + std::log(sum);
    e.logprob.push_back(double(row[generated[g]]) - lse);
    std::vector<double> all;
    for (int64_t v = 0; v < V; ++v) all.push_back(double(row[v]) - lse);
    std::partial_sort(all.begin(), all.begin() + std::ptrdiff_t(k), all.end(), std::greater<>());
    e.top.emplace_back(all.begin(), all.begin() + std::ptrdiff_t(k));
  }
  return e;
}

// The id of a token from the bytes the response reports for it.
int32_t id_of(const Tokenizer& tok, const json& bytes) {
  static std::map<std::string, int32_t> by_piece;
  if (by_piece.empty())
    for (int32_t id = 0; id < int32_t(tok.vocab_size()); ++id) by_piece.emplace(tok.token_to_piece(id), id);
  std::string s;
  for (const auto& b : bytes) s += char(b.get<int>());
  auto it = by_piece.find(s);
  EXPECT_NE(it, by_piece.end()) << "no token has these bytes";
  return it == by_piece.end() ? -1 : it->second;
}

void expect_matches(const Expected& e, const std::vector<double>& got, const std::vector<std::vector<double>>& got_top) {
  ASSERT_EQ(got.size(), e.logprob.size());
  for (size_t g = 0; g < got.size(); ++g) {
    // The server decodes token by token, `logits` runs one batch: float
    // rounding differs a little, nothing more.
    EXPECT_NEAR(got[g], e.logprob[g], 2e-3) << "position " << g;
    ASSERT_EQ(got_top[g].size(), e.top[g].size());
    for (size_t j = 0; j < got_top[g].size(); ++j) EXPECT_NEAR(got_top[g][j], e.top[g][j], 2e-3) << g << "," << j;
  }
}

}  // namespace

TEST(ServerLogprobs, CompletionsEqualLogSoftmaxOfFlashmoeLogits) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  const Tokenizer tok = Tokenizer::load(source_path("models/coder-mini"));
  const std::string prompt = "def fib(n):\n    if n < 2:\n";
  int st = 0;
  // Sampled, not greedy (temperature 1.3, top_k 50): the log-probabilities
  // are still the model's own distribution's.
  json r = post_json(c, "/v1/completions",
                     {{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 1.3}, {"top_k", 50}, {"seed", 11},
                      {"logprobs", 3}, {"ignore_eos", true}},
                     &st);
  ASSERT_EQ(st, 200) << r.dump();
  const json& lp = r["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 6u) << lp.dump();
  std::vector<int32_t> gen;
  std::string text;
  std::vector<double> got;
  std::vector<std::vector<double>> got_top;
  for (size_t g = 0; g < 6; ++g) {
    const std::string piece = lp["tokens"][g].get<std::string>();
    json bytes = json::array();
    for (unsigned char ch : piece) bytes.push_back(int(ch));
    gen.push_back(id_of(tok, bytes));
    text += piece;
    got.push_back(lp["token_logprobs"][g].get<double>());
    std::vector<double> t;
    for (auto& [k, v] : lp["top_logprobs"][g].items()) t.push_back(v.get<double>());
    std::sort(t.begin(), t.end(), std::greater<>());
    got_top.push_back(t);
    EXPECT_EQ(lp["text_offset"][g].get<size_t>(), text.size() - piece.size());
  }
  EXPECT_EQ(text, r["choices"][0]["text"].get<std::string>());
  expect_matches(reference(tok.encode(prompt), gen, 3), got, got_top);
}

TEST(ServerLogprobs, StreamedChatEqualLogSoftmaxOfFlashmoeLogits) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  const Tokenizer tok = Tokenizer::load(source_path("models/coder-mini"));
  const ChatTemplate tmpl = ChatTemplate::load(source_path("models/coder-mini"));
  json body = chat_body({{"user", "Write a function that reverses a list."}}, 5);
  body["logprobs"] = true;
  body["top_logprobs"] = 4;
  body["stream"] = true;
  body["ignore_eos"] = true;
  auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  std::vector<int32_t> gen;
  std::vector<double> got;
  std::vector<std::vector<double>> got_top;
  std::string text;
  for (size_t i = 0; (i = res->body.find("data: ", i)) != std::string::npos;) {
    size_t end = res->body.find("\n\n", i);
    std::string data = res->body.substr(i + 6, end - i - 6);
    i = end;
    if (data == "[DONE]") break;
    json ch = json::parse(data);
    if (ch["choices"].empty() || ch["choices"][0]["logprobs"].is_null()) continue;
    if (ch["choices"][0]["delta"].contains("content")) text += ch["choices"][0]["delta"]["content"].get<std::string>();
    for (const auto& e : ch["choices"][0]["logprobs"]["content"]) {
      gen.push_back(id_of(tok, e["bytes"]));
      got.push_back(e["logprob"].get<double>());
      std::vector<double> t;
      for (const auto& x : e["top_logprobs"]) t.push_back(x["logprob"].get<double>());
      got_top.push_back(t);
      // Greedy: the token is the most likely one.
      EXPECT_EQ(e["top_logprobs"][0]["token"], e["token"]);
    }
  }
  ASSERT_EQ(gen.size(), 5u) << res->body;
  const json msgs = json::array({{{"role", "user"}, {"content", "Write a function that reverses a list."}}});
  expect_matches(reference(tok.encode(tmpl.render(nlohmann::ordered_json::parse(msgs.dump()), true)), gen, 4), got, got_top);
}

}  // namespace server_logprobs_e2e_test
