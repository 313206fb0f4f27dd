// The HTTP-free parts of the server: request validation and the snapshot
// pool's prefix matching and LRU bound.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

#include "server/http_exchange.h"
#include "server/openai_api.h"
#include "server/request_guard.h"
#include "server/state_cache.h"

namespace server_api_test {

using namespace flashmoe;
using namespace flashmoe::server;

namespace {

int status_of(const std::string& body, bool chat = true) {
  try {
    parse_completion_request(body, chat);
    return 200;
  } catch (const ApiError& e) {
    return e.status;
  }
}

// A snapshot of a state that holds no memory: the cache's bookkeeping is
// about tokens and bytes, whatever the backend.
struct EmptyState : StateSnapshot {
  int64_t pos = 0;
  int64_t position() const override { return pos; }
  size_t bytes() const override { return 0; }
};
Snapshot snap(std::vector<int32_t> tokens) {
  auto s = std::make_shared<EmptyState>();
  s->pos = int64_t(tokens.size());
  return {std::move(tokens), s};
}

}  // namespace

TEST(ServerApi, ParsesChatRequest) {
  auto r = parse_completion_request(
      R"({"model":"m","messages":[{"role":"developer","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],
          "temperature":0.5,"top_p":0.9,"max_tokens":12,"stop":"\n","seed":7,"stream":true,
          "stream_options":{"include_usage":true},"presence_penalty":0.1,"frequency_penalty":-0.2})",
      true);
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[0]["role"], "system");
  EXPECT_EQ(r.messages[1]["content"], "hi");
  EXPECT_FLOAT_EQ(*r.temperature, 0.5f);
  EXPECT_EQ(*r.max_tokens, 12);
  EXPECT_EQ(r.stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(*r.seed, 7u);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(ServerApi, RejectsBadRequests) {
  EXPECT_EQ(status_of("{not json"), 400);
  EXPECT_EQ(status_of("[1,2]"), 400);
  EXPECT_EQ(status_of(R"({"messages":"hi"})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[]})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"wizard","content":"x"}]})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"user","content":"x"}],"temperature":"hot"})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"user","content":"x"}],"temperature":5})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":1.5})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"user","content":"x"}],"stop":[1]})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"user","content":"x"}],"stream":"yes"})"), 400);
  EXPECT_EQ(status_of(R"({"messages":[{"role":"user","content":"x"}],"n":2})"), 400);
  EXPECT_EQ(status_of(R"({"prompt":5})", false), 400);
  EXPECT_EQ(status_of(R"({"prompt":""})", false), 400);
  EXPECT_EQ(status_of(R"({"prompt":"def f():","temperature":null})", false), 200);
}

TEST(ServerStateCache, LongestProperPrefixWinsAndLruBounds) {
  StateCache c(2);
  c.put(snap({1, 2}));
  c.put(snap({1, 2, 3, 4}));
  auto s = c.find({1, 2, 3, 4, 5});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->tokens.size(), 4u);
  // An exact match leaves nothing to feed, so the shorter prefix is used.
  s = c.find({1, 2, 3, 4});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->tokens.size(), 2u);
  EXPECT_FALSE(c.find({9, 1, 2}));
  // {1,2} was used last; adding a third entry evicts {1,2,3,4}.
  c.put(snap({7, 8}));
  EXPECT_EQ(c.size(), 2u);
  s = c.find({1, 2, 3, 4, 5});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->tokens.size(), 2u);

  // The byte budget evicts too: each of these snapshots holds 2 ints.
  StateCache small(8, 3 * 2 * sizeof(int32_t));
  for (int i = 0; i < 5; ++i) small.put(snap({i, i}));
  EXPECT_EQ(small.size(), 3u);
  EXPECT_EQ(small.bytes(), 3 * 2 * sizeof(int32_t));
  EXPECT_TRUE(small.find({4, 4, 1}));
  EXPECT_FALSE(small.find({1, 1, 1}));

  StateCache off(0);
  off.put(snap({1, 2}));
  EXPECT_EQ(off.size(), 0u);
  EXPECT_FALSE(off.find({1, 2, 3}));
}

// A streamed answer's conversation is stored after its last event
// (StateCache::Pending): a lookup that it would serve better waits for it,
// one that it would not serve does not, and the wait is bounded.
TEST(ServerStateCache, PendingStoreIsWaitedForWhereItIsTheBetterMatch) {
  using namespace std::chrono;
  StateCache c(8);
  c.put(snap({1, 2}));
  auto pending = std::make_unique<StateCache::Pending>(c, std::vector<int32_t>{1, 2, 3, 4}, "");
  // Not extended by this prompt: answered at once with what is there.
  auto t0 = steady_clock::now();
  auto s = c.find({1, 2, 9, 9});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->tokens.size(), 2u);
  // Another partition never waits for it either.
  EXPECT_FALSE(c.find({1, 2, 3, 4, 5}, "key1/0:"));
  EXPECT_LT(duration<double>(steady_clock::now() - t0).count(), 1.0);
  // Extended: waits until the store lands, then gets it.
  std::thread storer([&] {
    std::this_thread::sleep_for(milliseconds(100));
    c.put(snap({1, 2, 3, 4}));
    pending->done();
  });
  t0 = steady_clock::now();
  s = c.find({1, 2, 3, 4, 5});
  storer.join();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->tokens.size(), 4u);
  EXPECT_GE(duration<double>(steady_clock::now() - t0).count(), 0.05);
  // A store that never comes (dropped without done(): the destructor ends
  // it), or one left pending: find() gives up after its wait.
  StateCache::Pending stuck(c, {1, 2, 3, 4, 5, 6}, "");
  t0 = steady_clock::now();
  s = c.find({1, 2, 3, 4, 5, 6, 7}, "", milliseconds(50));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->tokens.size(), 4u);
  EXPECT_GE(duration<double>(steady_clock::now() - t0).count(), 0.04);
  stuck.done();
  EXPECT_EQ(c.find({1, 2, 3, 4, 5, 6, 7})->tokens.size(), 4u);
}

// Numbers past int64_t and content parts of the wrong type are 400s naming
// the field (were "must be at least 1" for 2^63, and a 500 for a type of 5).
TEST(ServerApi, OutOfRangeNumbersAndBadPartsName) {
  auto error_of = [](const std::string& body) -> ApiError {
    try {
      parse_completion_request(body, true);
    } catch (const ApiError& e) {
      return e;
    }
    return ApiError(200, "accepted");
  };
  const std::string msgs = R"("messages":[{"role":"user","content":"x"}])";
  for (const char* n : {"9223372036854775808", "18446744073709551615", "1e30", "-9223372036854775809"}) {
    ApiError e = error_of("{" + msgs + ",\"max_tokens\":" + n + "}");
    EXPECT_EQ(e.status, 400) << n;
    EXPECT_EQ(e.param, "max_tokens") << n;
    EXPECT_NE(std::string(e.what()).find("between 1 and 9223372036854775807"), std::string::npos) << e.what();
  }
  ApiError e = error_of(R"({"messages":[{"role":"user","content":[{"type":5}]}]})");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "messages[0].content");
  EXPECT_EQ(error_of(R"({"messages":[{"role":"user","content":[5]}]})").status, 400);
  EXPECT_EQ(error_of(R"({"messages":[{"role":"user","content":[{"type":"text","text":7}]}]})").status, 400);
  // A seed takes the whole unsigned 64-bit range.
  auto r = parse_completion_request("{" + msgs + ",\"seed\":18446744073709551615}", true);
  EXPECT_EQ(*r.seed, 18446744073709551615ull);
  EXPECT_EQ(parse_completion_request("{" + msgs + ",\"seed\":-1}", true).seed, uint64_t(-1));
  EXPECT_EQ(parse_completion_request("{" + msgs + ",\"cache_salt\":\"t1\"}", true).cache_salt, "t1");
  EXPECT_EQ(error_of("{" + msgs + ",\"cache_salt\":1}").param, "cache_salt");
}

TEST(ServerStateCache, PartitionsNeverShare) {
  StateCache c(8);
  c.put(snap({1, 2, 3}), "key0/0:");
  EXPECT_TRUE(c.find({1, 2, 3, 4}, "key0/0:"));
  EXPECT_FALSE(c.find({1, 2, 3, 4}, "key1/0:"));
  EXPECT_FALSE(c.find({1, 2, 3, 4}, "key0/2:s1"));
  EXPECT_FALSE(c.find({1, 2, 3, 4}));
  // The same tokens in two partitions are two entries.
  c.put(snap({1, 2, 3}), "key1/0:");
  EXPECT_EQ(c.size(), 2u);
  EXPECT_TRUE(c.find({1, 2, 3, 4}, "key1/0:"));
}

namespace {
HttpRequest with_headers(std::vector<std::pair<std::string, std::string>> h) {
  HttpRequest r;
  r.method = "POST";
  r.path = "/v1/chat/completions";
  r.headers = std::move(h);
  return r;
}
}  // namespace

TEST(ServerRequestGuard, HostAndOriginRules) {
  OriginPolicy loop{"127.0.0.1", {}};
  EXPECT_FALSE(refuse_host_or_origin(with_headers({{"Host", "127.0.0.1:8080"}}), loop));
  EXPECT_FALSE(refuse_host_or_origin(with_headers({{"host", "localhost"}}), loop));
  EXPECT_FALSE(refuse_host_or_origin(with_headers({{"Host", "[::1]:8080"}}), loop));
  EXPECT_FALSE(refuse_host_or_origin(with_headers({}), loop));  // HTTP/1.0, no Host
  EXPECT_TRUE(refuse_host_or_origin(with_headers({{"Host", "attacker.example"}}), loop));
  EXPECT_TRUE(refuse_host_or_origin(with_headers({{"Host", "127.0.0.1.attacker.example"}}), loop));
  EXPECT_TRUE(refuse_host_or_origin(with_headers({{"Host", "127.evil.example"}}), loop));
  // Any Origin is refused by default (a page's fetch() to the server)...
  EXPECT_TRUE(refuse_host_or_origin(with_headers({{"Host", "127.0.0.1:8080"}, {"Origin", "https://a.example"}}), loop));
  EXPECT_TRUE(refuse_host_or_origin(with_headers({{"Host", "127.0.0.1:8080"}, {"Origin", "null"}}), loop));
  // ...unless listed (or "*").
  OriginPolicy listed{"127.0.0.1", {"https://a.example"}};
  auto req = with_headers({{"Host", "127.0.0.1:8080"}, {"Origin", "https://a.example"}});
  EXPECT_FALSE(refuse_host_or_origin(req, listed));
  EXPECT_EQ(cors_allow_origin(req, listed), "https://a.example");
  EXPECT_EQ(cors_allow_origin(req, loop), "");
  EXPECT_FALSE(refuse_host_or_origin(req, OriginPolicy{"127.0.0.1", {"*"}}));
  // A server bound to another address serves whatever names point at it.
  OriginPolicy wide{"0.0.0.0", {}};
  EXPECT_FALSE(refuse_host_or_origin(with_headers({{"Host", "gpu-box.lan:8080"}}), wide));
  EXPECT_TRUE(refuse_host_or_origin(with_headers({{"Host", "gpu-box.lan"}, {"Origin", "https://a.example"}}), wide));
}

TEST(ServerApi, IntegerRangesHoldForEveryJsonNumberKind) {
  // nlohmann keeps 0 and positive integers as unsigned: the lower bound
  // must hold for them too.
  for (const char* n : {"0", "-1", "0.0"}) {
    try {
      parse_completion_request(std::string(R"({"prompt":"x","max_tokens":)") + n + "}", false);
      ADD_FAILURE() << n << " accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.param, "max_tokens") << n;
    }
  }
  EXPECT_EQ(*parse_completion_request(R"({"prompt":"x","max_tokens":1})", false).max_tokens, 1);
  EXPECT_EQ(*parse_completion_request(R"({"prompt":"x","max_tokens":2.0})", false).max_tokens, 2);
}

}  // namespace server_api_test
