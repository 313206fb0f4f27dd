// `flashmoe serve` on the GPU: the same answers as on the CPU, concurrent
// requests taking turns on the one device, bad requests still answered 4xx.
// Skipped (with the reason) where no GPU is usable.
#include <gtest/gtest.h>

#include "backend/cuda/cuda_model.h"
#include "server_process.h"
#include "test_util.h"

namespace cuda_serve_test {

using namespace flashmoe::test::serve;
using flashmoe::CudaModel;
using flashmoe::test::ScopedEnv;

namespace {

std::vector<std::string> on(const std::string& device) {
  std::vector<std::string> a = standard_args();
  a.insert(a.end(), {"--device", device});
  return a;
}

std::string content(const json& r) { return r["choices"][0]["message"]["content"].get<std::string>(); }

// Greedy chat, a seeded sampled completion and the second turn of a
// conversation: the GPU server answers as the CPU server does (logits agree
// to ~1e-5, far from moving an argmax or a seeded draw here). The second
// turn starts from the first one's snapshot on both (the GPU's is its device
// state copied within VRAM), reusing as many tokens.
TEST(CudaServe, AnswersMatchTheCpu) {
  REQUIRE_GPU();
  START_SERVER(cpu, on("cpu"));
  START_SERVER(gpu, on("cuda"));
  EXPECT_NE(gpu.log().find("device cuda ("), std::string::npos) << gpu.log();
  auto cc = cpu.client(), gc = gpu.client();

  std::vector<std::pair<std::string, std::string>> turn = {{"system", "You are a helpful coding assistant."},
                                                           {"user", "Write a function to reverse a string."}};
  int sc = 0, sg = 0;
  const json c1 = post_json(cc, "/v1/chat/completions", chat_body(turn, 24), &sc);
  const json g1 = post_json(gc, "/v1/chat/completions", chat_body(turn, 24), &sg);
  ASSERT_EQ(sc, 200) << c1.dump();
  ASSERT_EQ(sg, 200) << g1.dump();
  EXPECT_FALSE(content(g1).empty());
  EXPECT_EQ(content(g1), content(c1));
  EXPECT_EQ(g1["usage"], c1["usage"]);

  turn.push_back({"assistant", content(c1)});
  turn.push_back({"user", "Now make it handle None."});
  const json c2 = post_json(cc, "/v1/chat/completions", chat_body(turn, 24));
  const json g2 = post_json(gc, "/v1/chat/completions", chat_body(turn, 24));
  EXPECT_EQ(content(g2), content(c2));
  EXPECT_GT(c2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), 0);
  EXPECT_EQ(g2["usage"]["prompt_tokens_details"]["cached_tokens"], c2["usage"]["prompt_tokens_details"]["cached_tokens"]);
  EXPECT_GT(metric(gc, "flashmoe_state_cache_entries"), 0);

  const json body = {{"prompt", "def merge_sorted(a, b):\n"}, {"max_tokens", 32}, {"temperature", 0.8}, {"seed", 7}};
  const json cs = post_json(cc, "/v1/completions", body), gs = post_json(gc, "/v1/completions", body);
  EXPECT_EQ(gs["choices"][0]["text"], cs["choices"][0]["text"]);
}

// --parallel 4 on one GPU: the slots' sessions take turns on the device
// (one lock, in request order); every answer is what it is alone.
TEST(CudaServe, ConcurrentRequestsShareTheGpu) {
  REQUIRE_GPU();
  START_SERVER(gpu, on("cuda"));
  const int n = 6;
  std::vector<json> bodies;
  for (int i = 0; i < n; ++i)
    bodies.push_back(chat_body({{"user", "Write function number " + std::to_string(i) + " in Python."}}, 16));
  std::vector<std::string> expect(n), got(n);
  {
    auto c = gpu.client();
    for (int i = 0; i < n; ++i) expect[size_t(i)] = content(post_json(c, "/v1/chat/completions", bodies[size_t(i)]));
  }
  std::vector<int> status(n, 0);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      auto c = gpu.client();
      auto r = c.Post("/v1/chat/completions", bodies[size_t(i)].dump(), "application/json");
      if (!r) return;
      status[size_t(i)] = r->status;
      got[size_t(i)] = content(json::parse(r->body));
    });
  for (auto& t : ts) t.join();
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(status[size_t(i)], 200) << "client " << i;
    EXPECT_EQ(got[size_t(i)], expect[size_t(i)]) << "client " << i;
  }
}

TEST(CudaServe, BadRequestsStillGet4xx) {
  REQUIRE_GPU();
  START_SERVER(gpu, on("cuda"));
  auto c = gpu.client();
  int st = 0;
  json e = post_json(c, "/v1/chat/completions", json{{"messages", "hello"}}, &st);
  EXPECT_EQ(st, 400) << e.dump();
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  std::string long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt += "x = foo(bar) ";
  e = post_json(c, "/v1/completions", json{{"prompt", long_prompt}}, &st);
  EXPECT_EQ(st, 400) << e.dump();
  EXPECT_EQ(e["error"]["code"], "context_length_exceeded");
  auto anon = gpu.client(false);
  auto r = anon.Post("/v1/completions", json{{"prompt", "x"}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  post_json(c, "/v1/chat/completions", chat_body({{"user", "hi"}}, 4), &st);
  EXPECT_EQ(st, 200);  // and it still serves
}

// The default (auto) serves on the GPU where one is usable.
TEST(CudaServe, AutoServesOnTheGpu) {
  REQUIRE_GPU();
  ScopedEnv unset("FLASHMOE_DEVICE", nullptr);  // the child inherits it at fork
  START_SERVER(srv, standard_args());
  EXPECT_NE(srv.log().find("device cuda ("), std::string::npos) << srv.log();
  auto c = srv.client();
  int st = 0;
  post_json(c, "/v1/chat/completions", chat_body({{"user", "hi"}}, 4), &st);
  EXPECT_EQ(st, 200);
}

}  // namespace

}  // namespace cuda_serve_test
