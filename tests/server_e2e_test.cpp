// End to end: starts the real `flashmoe serve` on coder-mini on a loopback
// port and talks plain HTTP to it, as a client would.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>

#include "server_process.h"
#include "test_util.h"

namespace server_e2e_test {

using json = nlohmann::json;
using namespace std::chrono_literals;
using namespace flashmoe::test::serve;
namespace http = flashmoe::test::http;
using flashmoe::test::read_file;
using flashmoe::test::source_path;
using flashmoe::test::TempDir;

namespace {

// Splits an SSE body into the JSON of each `data:` event; `done` says
// whether the stream ended with [DONE].
std::vector<json> sse_events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  size_t i = 0;
  while ((i = body.find("data: ", i)) != std::string::npos) {
    size_t end = body.find("\n\n", i);
    std::string data = body.substr(i + 6, end == std::string::npos ? std::string::npos : end - i - 6);
    if (data == "[DONE]") *done = true;
    else out.push_back(json::parse(data, nullptr, false));
    i = end == std::string::npos ? body.size() : end + 2;
  }
  return out;
}

}  // namespace

TEST(ServerE2E, ChatNonStreaming) {
  START_SERVER(srv, standard_args());
  EXPECT_NE(srv.log().find("(device cpu, 2 threads, batches of up to 4 requests"), std::string::npos) << srv.log();  // FLASHMOE_DEVICE=cpu
  auto c = srv.client();
  int st = 0;
  json r = post_json(c, "/v1/chat/completions", chat_body({{"user", "Write a Python function that adds two numbers."}}), &st);
  ASSERT_EQ(st, 200) << r.dump();
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["model"], "coder-mini");
  EXPECT_TRUE(r["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  const json& ch = r["choices"][0];
  EXPECT_EQ(ch["message"]["role"], "assistant");
  EXPECT_TRUE(ch["message"]["content"].is_string());
  EXPECT_FALSE(ch["message"]["content"].get<std::string>().empty());
  EXPECT_TRUE(ch["finish_reason"] == "stop" || ch["finish_reason"] == "length");
  const json& u = r["usage"];
  EXPECT_GT(u["prompt_tokens"].get<int>(), 5);
  EXPECT_GT(u["completion_tokens"].get<int>(), 0);
  EXPECT_LE(u["completion_tokens"].get<int>(), 16);
  EXPECT_EQ(u["total_tokens"], u["prompt_tokens"].get<int>() + u["completion_tokens"].get<int>());
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 0);

  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "coder-mini");
  auto one = c.Get("/v1/models/coder-mini");
  ASSERT_TRUE(one);
  EXPECT_EQ(json::parse(one->body)["id"], "coder-mini");
  auto none = c.Get("/v1/models/other");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST(ServerE2E, ChatStreamingMatchesNonStreaming) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  json body = chat_body({{"user", "Explain what a linked list is."}}, 24);
  json full = post_json(c, "/v1/chat/completions", body);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  bool done = false;
  auto ev = sse_events(r->body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text, finish;
  for (auto& e : ev) {
    if (e["choices"].empty()) continue;
    const json& ch = e["choices"][0];
    if (ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(text, full["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_EQ(finish, full["choices"][0]["finish_reason"].get<std::string>());
  // The usage chunk comes last, with empty choices.
  EXPECT_TRUE(ev.back()["choices"].empty());
  EXPECT_EQ(ev.back()["usage"]["completion_tokens"], full["usage"]["completion_tokens"]);
}

TEST(ServerE2E, CompletionsStreaming) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  json body = {{"prompt", "def fibonacci(n):\n"}, {"max_tokens", 16}, {"temperature", 0}, {"stream", true}};
  auto r = c.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  bool done = false;
  auto ev = sse_events(r->body, &done);
  EXPECT_TRUE(done);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev[0]["object"], "text_completion");
  EXPECT_FALSE(ev.back()["choices"][0]["finish_reason"].is_null());
}

TEST(ServerE2E, MultiTurnReusesConversationState) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  std::vector<std::pair<std::string, std::string>> turn = {{"system", "You are a helpful coding assistant."},
                                                           {"user", "Write a function to reverse a string."}};
  json r1 = post_json(c, "/v1/chat/completions", chat_body(turn, 24));
  std::string answer = r1["choices"][0]["message"]["content"];
  turn.push_back({"assistant", answer});
  turn.push_back({"user", "Now make it handle None."});
  json r2 = post_json(c, "/v1/chat/completions", chat_body(turn, 24));
  int64_t cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"];
  // At least turn 1's prompt (everything up to the generation prompt) is reused.
  EXPECT_GT(cached, r1["usage"]["prompt_tokens"].get<int64_t>() - 5);
  EXPECT_LT(cached, r2["usage"]["prompt_tokens"].get<int64_t>());
  EXPECT_GE(metric(c, "flashmoe_prompt_tokens_reused_total"), cached);
  EXPECT_GT(metric(c, "flashmoe_state_cache_entries"), 0);

  // Same conversation without reuse: the same (greedy) answer, nothing cached.
  auto args = standard_args();
  args.insert(args.end(), {"--state-cache", "0"});
  START_SERVER(plain, args);
  auto c0 = plain.client();
  json p1 = post_json(c0, "/v1/chat/completions", chat_body({turn[0], turn[1]}, 24));
  EXPECT_EQ(p1["choices"][0]["message"]["content"], answer);
  json p2 = post_json(c0, "/v1/chat/completions", chat_body(turn, 24));
  EXPECT_EQ(p2["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(p2["choices"][0]["message"]["content"], r2["choices"][0]["message"]["content"]);
  EXPECT_EQ(metric(c0, "flashmoe_prompt_tokens_reused_total"), 0);
}

// A streamed answer's conversation is stored after its [DONE]
// (StateCache::Pending): a follow-up sent the moment the stream ends still
// starts from it, prompt and answer alike.
TEST(ServerE2E, FollowUpRightAfterAStreamReusesItsAnswer) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  const std::string prompt = "def binary_search(items, target):\n";
  json b1 = {{"prompt", prompt}, {"max_tokens", 16}, {"temperature", 0}, {"ignore_eos", true}, {"stream", true},
             {"stream_options", {{"include_usage", true}}}};
  auto r = c.Post("/v1/completions", b1.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  bool done = false;
  std::string text;
  int64_t prompt_tokens = 0, generated = 0;
  for (auto& e : sse_events(r->body, &done)) {
    if (e.contains("usage") && e["usage"].is_object()) {
      prompt_tokens = e["usage"]["prompt_tokens"];
      generated = e["usage"]["completion_tokens"];
    }
    if (!e["choices"].empty()) text += e["choices"][0].value("text", "");
  }
  ASSERT_TRUE(done);
  ASSERT_EQ(generated, 16);
  // At once (same connection), the conversation so far plus a little more.
  json b2 = {{"prompt", prompt + text + "\n# test\n"}, {"max_tokens", 4}, {"temperature", 0}};
  json r2 = post_json(c, "/v1/completions", b2);
  const int64_t cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"];
  // The answer's ids re-tokenize to themselves for this code (checked by
  // /tokenize), so the stored prompt + answer is a prefix of turn 2.
  json tk = post_json(c, "/tokenize", json{{"content", prompt + text}});
  if (int64_t(tk["tokens"].size()) != prompt_tokens + generated) GTEST_SKIP() << "the answer re-tokenizes differently";
  EXPECT_EQ(cached, prompt_tokens + generated);
}

TEST(ServerE2E, StopStrings) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  json body = {{"prompt", "def bubble_sort(items):\n"}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}};
  json full = post_json(c, "/v1/completions", body);
  std::string text = full["choices"][0]["text"];
  ASSERT_GE(text.size(), 12u) << text;
  std::string stop = text.substr(6, 3);
  std::string expect = text.substr(0, text.find(stop));
  body["stop"] = stop;
  json r = post_json(c, "/v1/completions", body);
  EXPECT_EQ(r["choices"][0]["text"], expect);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  body["stop"] = json::array({"@@never@@", stop});
  r = post_json(c, "/v1/completions", body);
  EXPECT_EQ(r["choices"][0]["text"], expect);
}

TEST(ServerE2E, SeedReproducesSampling) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  json body = chat_body({{"user", "Write a haiku about compilers."}}, 24);
  body["temperature"] = 1.0;
  body["seed"] = 1234;
  json a = post_json(c, "/v1/chat/completions", body);
  json b = post_json(c, "/v1/chat/completions", body);
  EXPECT_EQ(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
  EXPECT_FALSE(a["choices"][0]["message"]["content"].get<std::string>().empty());
}

TEST(ServerE2E, ApiKeyRequired) {
  START_SERVER(srv, standard_args());
  auto anon = srv.client(false);
  auto r = anon.Post("/v1/chat/completions", chat_body({{"user", "hi"}}).dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  json e = json::parse(r->body);
  EXPECT_EQ(e["error"]["type"], "authentication_error");
  r = anon.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = anon.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  http::Client wrong("127.0.0.1", srv.port());
  wrong.set_default_headers({{"Authorization", "Bearer nope"}});
  r = wrong.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = anon.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST(ServerE2E, BadRequestsGet400WithJsonError) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  auto expect_400 = [&](const std::string& path, const std::string& body, const std::string& code = "") {
    auto r = c.Post(path.c_str(), body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << body << " -> " << r->body;
    json e = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(e.is_object()) << r->body;
    EXPECT_EQ(e["error"]["type"], "invalid_request_error") << r->body;
    EXPECT_TRUE(e["error"]["message"].is_string());
    EXPECT_EQ(r->body.find("/work"), std::string::npos) << "leaks a path: " << r->body;
    EXPECT_EQ(r->body.find(FLASHMOE_SOURCE_DIR), std::string::npos) << "leaks a path: " << r->body;
    if (!code.empty()) {
      EXPECT_EQ(e["error"]["code"], code) << r->body;
    }
  };
  expect_400("/v1/chat/completions", "{\"messages\": [");
  expect_400("/v1/chat/completions", R"({"messages": "hello"})");
  expect_400("/v1/chat/completions", R"({"messages": [{"role":"user","content":"hi"}], "temperature": "warm"})");
  expect_400("/v1/chat/completions", R"({"model":"gpt-4","messages": [{"role":"user","content":"hi"}]})",
             "model_not_found");
  expect_400("/v1/chat/completions", R"({"messages": [{"role":"user","content":"hi"}], "max_tokens": -3})");
  expect_400("/v1/completions", R"({"prompt": ["a", "b"]})");
  // Longer than this server's 512-token context.
  std::string long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt += "x = foo(bar) ";
  expect_400("/v1/completions", json{{"prompt", long_prompt}}.dump(), "context_length_exceeded");
  // Unknown route: 404 with the same error shape.
  auto r = c.Get("/v1/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_TRUE(json::parse(r->body, nullptr, false).contains("error"));
  // And the server still serves.
  int st = 0;
  post_json(c, "/v1/chat/completions", chat_body({{"user", "hi"}}, 4), &st);
  EXPECT_EQ(st, 200);
}

TEST(ServerE2E, OversizedBodyGets413) {
  START_SERVER(srv, standard_args());
  auto c = srv.client();
  json body = chat_body({{"user", std::string(100000, 'a')}});
  auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(json::parse(r->body, nullptr, false).contains("error")) << r->body;
  auto c2 = srv.client();
  int st = 0;
  post_json(c2, "/v1/chat/completions", chat_body({{"user", "hi"}}, 4), &st);
  EXPECT_EQ(st, 200);
}

TEST(ServerE2E, DisconnectMidStreamCancelsAndFreesTheSlot) {
  // One slot and no queue: the slot must come back for the next request.
  START_SERVER(srv, {"--parallel", "1", "--queue", "0", "-t", "1"});
  int fd = connect_to(srv.port());
  ASSERT_GE(fd, 0);
  std::string body = json{{"prompt", "def main():\n"}, {"max_tokens", 4000}, {"ignore_eos", true}, {"stream", true}}.dump();
  std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  std::string got;
  char buf[4096];
  while (got.find("data: ", got.find("data: ") + 1) == std::string::npos) {  // two events seen
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    got.append(buf, size_t(n));
  }
  EXPECT_NE(got.find("200 OK"), std::string::npos);

  // Meanwhile the only slot is busy and the queue is 0: a second request is refused.
  http::Client c("127.0.0.1", srv.port());
  c.set_read_timeout(60, 0);
  auto busy = c.Post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 2}}.dump(), "application/json");
  ASSERT_TRUE(busy);
  EXPECT_EQ(busy->status, 503);
  EXPECT_TRUE(json::parse(busy->body, nullptr, false).contains("error"));

  close(fd);
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline &&
         (metric(c, "flashmoe_generations_cancelled_total") < 1 || metric(c, "flashmoe_slots_busy") != 0))
    std::this_thread::sleep_for(20ms);
  EXPECT_EQ(metric(c, "flashmoe_generations_cancelled_total"), 1);
  EXPECT_EQ(metric(c, "flashmoe_slots_busy"), 0);
  // Far fewer than 4000 tokens were generated.
  EXPECT_LT(metric(c, "flashmoe_generated_tokens_total"), 3000);
  for (int i = 0; i < 2; ++i) {
    auto r = c.Post("/v1/completions", json{{"prompt", "def add(a, b):\n"}, {"max_tokens", 8}}.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
  }
}

// A streaming client that goes away while its long prompt is still being
// read: the prompt stops at the next step (no token is generated) and the
// only slot comes back, long before the prefill would have ended.
TEST(ServerE2E, DisconnectMidPrefillFreesTheSlot) {
  START_SERVER(srv, {"--parallel", "1", "--queue", "0", "-t", "1", "--batch-tokens", "16", "--state-cache", "0"});
  // ~2,500 tokens of code: at 16 a step, some 150 steps of prefill.
  std::string code = read_file(source_path("src/engine/generator.cpp"));
  code += read_file(source_path("src/engine/session.cpp"));
  int fd = connect_to(srv.port());
  ASSERT_GE(fd, 0);
  std::string body = json{{"prompt", code}, {"max_tokens", 8}, {"stream", true}}.dump();
  std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  std::string got;
  char buf[4096];
  while (got.find("data: ") == std::string::npos) {  // the first event: the request is running
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    got.append(buf, size_t(n));
  }
  close(fd);
  http::Client c("127.0.0.1", srv.port());
  c.set_read_timeout(60, 0);
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline &&
         (metric(c, "flashmoe_generations_cancelled_total") < 1 || metric(c, "flashmoe_slots_busy") != 0))
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(metric(c, "flashmoe_generations_cancelled_total"), 1);
  EXPECT_EQ(metric(c, "flashmoe_slots_busy"), 0);
  // Stopped inside the prefill: not one token was generated.
  EXPECT_EQ(metric(c, "flashmoe_generated_tokens_total"), 0);
  auto r = c.Post("/v1/completions", json{{"prompt", "def add(a, b):\n"}, {"max_tokens", 4}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
}

// Continuous batching under overload: 8 requests stream in one batch, 92
// wait in the queue, the 101st gets 503 at once; then all 100 clients go
// away mid-request and every gauge (slots, queue, batch, KV and recurrent
// state bytes) is back to 0.
TEST(ServerE2E, HundredCancelledRequestsLeaveNothingBehind) {
  START_SERVER(srv, {"--parallel", "8", "--queue", "92", "-t", "2", "--state-cache", "0"});
  std::string body = json{{"prompt", "def main():\n"}, {"max_tokens", 4000}, {"ignore_eos", true}, {"stream", true}}.dump();
  std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  std::vector<int> fds;
  for (int i = 0; i < 100; ++i) {
    int fd = connect_to(srv.port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
    fds.push_back(fd);
  }
  http::Client c("127.0.0.1", srv.port());
  c.set_read_timeout(60, 0);
  auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline &&
         (metric(c, "flashmoe_slots_busy") != 8 || metric(c, "flashmoe_queue_waiting") != 92))
    std::this_thread::sleep_for(20ms);
  ASSERT_EQ(metric(c, "flashmoe_slots_busy"), 8);
  ASSERT_EQ(metric(c, "flashmoe_queue_waiting"), 92);
  EXPECT_EQ(metric(c, "flashmoe_batch_sequences_active"), 8);
  const auto t0 = std::chrono::steady_clock::now();
  auto busy = c.Post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 2}}.dump(), "application/json");
  ASSERT_TRUE(busy);
  EXPECT_EQ(busy->status, 503) << busy->body;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0) << "503 not at once";
  // Summed over the steps so far (prompts joining one by one, then 8 decoding).
  deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline && metric(c, "flashmoe_batch_steps_total") < 40)
    std::this_thread::sleep_for(20ms);
  EXPECT_GT(metric(c, "flashmoe_batch_step_sequences_total"), 2 * metric(c, "flashmoe_batch_steps_total"))
      << "the running requests were not batched";

  for (int fd : fds) close(fd);
  const char* gauges[] = {"flashmoe_slots_busy", "flashmoe_queue_waiting", "flashmoe_batch_sequences_active",
                          "flashmoe_batch_last_step_sequences", "flashmoe_kv_cache_bytes",
                          "flashmoe_recurrent_state_bytes"};
  auto all_zero = [&] {
    for (const char* g : gauges)
      if (metric(c, g) != 0) return false;
    return true;
  };
  deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline && !all_zero()) std::this_thread::sleep_for(50ms);
  for (const char* g : gauges) EXPECT_EQ(metric(c, g), 0) << g;
  EXPECT_EQ(metric(c, "flashmoe_generations_cancelled_total"), 100);
  auto r = c.Post("/v1/completions", json{{"prompt", "def add(a, b):\n"}, {"max_tokens", 4}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
}

TEST(ServerE2E, EightConcurrentClients) {
  START_SERVER(srv, standard_args());
  const int n = 8;
  std::vector<json> bodies;
  for (int i = 0; i < n; ++i)
    bodies.push_back(chat_body({{"user", "Write function number " + std::to_string(i) + " in Python."}}, 16));
  // Greedy answers one at a time first...
  std::vector<std::string> expect(n);
  {
    auto c = srv.client();
    for (int i = 0; i < n; ++i) expect[size_t(i)] = post_json(c, "/v1/chat/completions", bodies[size_t(i)])["choices"][0]["message"]["content"];
  }
  // ...then all at once, half of them streamed.
  std::vector<std::string> got(n);
  std::vector<int> status(n, 0);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      auto c = srv.client();
      json b = bodies[size_t(i)];
      if (i % 2) {
        b["stream"] = true;
        auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
        if (!r) return;
        status[size_t(i)] = r->status;
        bool done = false;
        for (auto& e : sse_events(r->body, &done))
          if (!e["choices"].empty() && e["choices"][0]["delta"].contains("content"))
            got[size_t(i)] += e["choices"][0]["delta"]["content"].get<std::string>();
        if (!done) status[size_t(i)] = -1;
      } else {
        auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
        if (!r) return;
        status[size_t(i)] = r->status;
        got[size_t(i)] = json::parse(r->body)["choices"][0]["message"]["content"];
      }
    });
  for (auto& t : ts) t.join();
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(status[size_t(i)], 200) << "client " << i;
    EXPECT_EQ(got[size_t(i)], expect[size_t(i)]) << "client " << i;
  }
}

}  // namespace server_e2e_test
