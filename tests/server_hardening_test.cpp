// The HTTP layer against hostile or careless clients, and the server's
// security options: each test here is one defect of issue 19 that failed on
// the cpp-httplib server (slowloris, header floods, chunked bodies past
// --max-body, a 5-deep listen backlog, a second server on a port in use,
// shutdown answering "stop", empty POSTs held 30 s, no Host/Origin check,
// one state cache for every client). The deadlines are short server options
// (--read-timeout) so the whole file stays a few seconds; the full-size abuse
// run is bench/server_abuse.sh.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "server_process.h"
#include "test_util.h"

namespace server_hardening_test {

using json = nlohmann::json;
using namespace std::chrono_literals;
using namespace flashmoe::test::serve;
namespace http = flashmoe::test::http;
using flashmoe::test::read_file;
using flashmoe::test::sanitizer_build;
using flashmoe::test::source_path;
using flashmoe::test::TempDir;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Time bounds stretch under the sanitizers (make test-asan), where the
// server runs several times slower.
double slack() { return sanitizer_build() ? 4.0 : 1.0; }

bool send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += size_t(n);
  }
  return true;
}

// Everything the server sends until it closes the connection or `timeout`
// passes; *closed says which.
std::string read_until_closed(int fd, std::chrono::milliseconds timeout, bool* closed = nullptr) {
  std::string got;
  auto deadline = Clock::now() + timeout;
  if (closed) *closed = false;
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (poll(&p, 1, std::max(left, 1)) <= 0) continue;
    char buf[8192];
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      if (closed) *closed = true;
      break;
    }
    got.append(buf, size_t(n));
  }
  return got;
}

int status_of(const std::string& raw) {
  if (raw.rfind("HTTP/1.", 0) != 0 || raw.size() < 12) return 0;
  return std::stoi(raw.substr(9, 3));
}

std::string body_of(const std::string& raw) {
  size_t i = raw.find("\r\n\r\n");
  return i == std::string::npos ? "" : raw.substr(i + 4);
}

json completion(int max_tokens = 2) { return {{"prompt", "def add(a, b):"}, {"max_tokens", max_tokens}, {"temperature", 0}}; }

}  // namespace

// 20 connections trickle a header byte every 100 ms: the deadline is for the
// whole request (not renewed by each byte), so each is dropped after
// --read-timeout, and meanwhile /health and a completion are answered at once
// (the connections hold no worker thread).
TEST(ServerHardening, SlowClientsDoNotHoldTheServer) {
  START_SERVER(srv, {"--parallel", "1", "--queue", "2", "-t", "1", "--read-timeout", "1.5"});
  std::vector<int> slow;
  for (int i = 0; i < 20; ++i) {
    int fd = connect_to(srv.port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "));
    slow.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    while (!stop) {
      for (int fd : slow) send(fd, "a", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      std::this_thread::sleep_for(100ms);
    }
  });
  std::this_thread::sleep_for(300ms);
  auto c = srv.client();
  c.set_read_timeout(int(5 * slack()));
  auto t0 = Clock::now();
  auto h = c.Get("/health");
  ASSERT_TRUE(h) << "/health not answered while 20 clients trickle";
  EXPECT_EQ(h->status, 200);
  EXPECT_LT(seconds_since(t0), 0.5 * slack());
  t0 = Clock::now();
  int st = 0;
  post_json(c, "/v1/completions", completion(), &st);
  EXPECT_EQ(st, 200);
  EXPECT_LT(seconds_since(t0), 2.0 * slack());
  // Every trickling connection is closed by the deadline (answered 408 or
  // just closed), although it never stopped sending.
  t0 = Clock::now();
  int closed_count = 0;
  for (int fd : slow) {
    bool closed = false;
    std::string got = read_until_closed(fd, std::chrono::milliseconds(int(3000 * slack())), &closed);
    if (closed) ++closed_count;
    if (!got.empty()) {
      EXPECT_EQ(status_of(got), 408) << got;
    }
  }
  stop = true;
  trickle.join();
  for (int fd : slow) close(fd);
  EXPECT_EQ(closed_count, 20);
  EXPECT_LT(seconds_since(t0), 3.0 * slack());
}

// Limits that hold before the body is read, and before the API key is
// looked at; the connection is closed after the answer.
TEST(ServerHardening, HeaderAndBodyLimits) {
  START_SERVER(srv, standard_args());
  // 2,000 header lines (no key): 431 at once, not 401 after reading them all.
  {
    int fd = connect_to(srv.port());
    std::string req = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    for (int i = 0; i < 2000; ++i) req += "X-Pad-" + std::to_string(i) + ": 1\r\n";
    req += "\r\n";
    send_all(fd, req);
    bool closed = false;
    std::string got = read_until_closed(fd, 3000ms, &closed);
    EXPECT_EQ(status_of(got), 431) << got.substr(0, 200);
    EXPECT_NE(body_of(got).find("\"error\""), std::string::npos) << got;
    EXPECT_TRUE(closed);
    close(fd);
  }
  // A few hundred short fields fit in the byte limit but not in the count.
  {
    int fd = connect_to(srv.port());
    std::string req = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    for (int i = 0; i < 300; ++i) req += "X" + std::to_string(i) + ": 1\r\n";
    send_all(fd, req + "\r\n");
    std::string got = read_until_closed(fd, 3000ms);
    EXPECT_EQ(status_of(got), 431) << got.substr(0, 200);
    close(fd);
  }
  // A 2 MB chunked body against --max-body 65536: 413 once the limit is
  // passed, without the rest being read (or tokenized).
  {
    int fd = connect_to(srv.port());
    send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + kKey +
                     "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n");
    std::string chunk(16384, 'x');
    char size_line[32];
    std::snprintf(size_line, sizeof size_line, "%zx\r\n", chunk.size());
    // Chunks until the server stops reading (up to 2 MB).
    for (int i = 0; i < 128 && send_all(fd, size_line + chunk + "\r\n"); ++i) {
    }
    std::string got = read_until_closed(fd, 3000ms);
    EXPECT_EQ(status_of(got), 413) << got.substr(0, 300);
    EXPECT_NE(body_of(got).find("65536"), std::string::npos) << got;
    close(fd);
  }
  // A POST without a body (no Content-Length): 400 at once, naming it.
  {
    int fd = connect_to(srv.port());
    auto t0 = Clock::now();
    send_all(fd, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + kKey + "\r\n\r\n");
    std::string got;
    while (got.find("}") == std::string::npos && seconds_since(t0) < 5) got += read_until_closed(fd, 200ms);
    EXPECT_EQ(status_of(got), 400) << got;
    EXPECT_NE(got.find("body is empty"), std::string::npos) << got;
    EXPECT_LT(seconds_since(t0), 1.0 * slack());
    close(fd);
  }
  auto c = srv.client();
  // curl -d's content type: the body is JSON all the same.
  auto r = c.Post("/v1/completions", completion().dump(), "application/x-www-form-urlencoded");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  // Out-of-range and malformed fields: 400 naming them (were 500 and a
  // wrong message).
  int st = 0;
  json e = post_json(c, "/v1/chat/completions",
                     {{"messages", {{{"role", "user"}, {"content", {{{"type", 5}}}}}}}, {"max_tokens", 2}}, &st);
  EXPECT_EQ(st, 400) << e.dump();
  json body = completion();
  body["max_tokens"] = 9223372036854775808ull;  // 2^63
  e = post_json(c, "/v1/completions", body, &st);
  EXPECT_EQ(st, 400) << e.dump();
  EXPECT_EQ(e["error"]["param"], "max_tokens") << e.dump();
  EXPECT_NE(e["error"]["message"].get<std::string>().find("between 1 and"), std::string::npos) << e.dump();
  body["max_tokens"] = 10000000;
  e = post_json(c, "/v1/completions", body, &st);
  EXPECT_EQ(st, 400) << e.dump();
  EXPECT_NE(e["error"]["message"].get<std::string>().find("at most 4096"), std::string::npos) << e.dump();
  // And the server still serves.
  post_json(c, "/v1/completions", completion(), &st);
  EXPECT_EQ(st, 200);
}

// 300 connections at once (a real listen backlog, not 5): every one is
// accepted and answered well within the 1 s a dropped SYN costs.
TEST(ServerHardening, ConnectionBurstIsAnsweredAtOnce) {
  START_SERVER(srv, standard_args());
  const int n = 300;
  std::vector<int> fds;
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(srv.port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    fds.push_back(fd);
  }
  const std::string req = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  std::vector<std::string> got(static_cast<size_t>(n));
  std::vector<bool> sent(size_t(n), false), done(size_t(n), false);
  int finished = 0;
  while (finished < n && seconds_since(t0) < 5) {
    std::vector<pollfd> ps;
    for (int i = 0; i < n; ++i)
      if (!done[size_t(i)]) ps.push_back({fds[size_t(i)], short(sent[size_t(i)] ? POLLIN : POLLOUT), 0});
    poll(ps.data(), ps.size(), 100);
    for (auto& p : ps) {
      size_t i = size_t(std::find(fds.begin(), fds.end(), p.fd) - fds.begin());
      if (!sent[i] && (p.revents & POLLOUT)) sent[i] = send(p.fd, req.data(), req.size(), MSG_NOSIGNAL) == ssize_t(req.size());
      else if (sent[i] && (p.revents & (POLLIN | POLLHUP))) {
        char buf[4096];
        ssize_t k = recv(p.fd, buf, sizeof buf, 0);
        if (k > 0) got[i].append(buf, size_t(k));
        else {
          done[i] = true;
          ++finished;
        }
      }
    }
  }
  double took = seconds_since(t0);
  int ok = 0;
  for (int i = 0; i < n; ++i) {
    if (status_of(got[size_t(i)]) == 200) ++ok;
    close(fds[size_t(i)]);
  }
  EXPECT_EQ(ok, n);
  EXPECT_LT(took, 0.9 * slack()) << "a connection waited for a SYN retransmit";
}

// A second server on a port in use exits non-zero with a clear message
// instead of sharing the port's traffic (no SO_REUSEPORT).
TEST(ServerHardening, PortInUseIsRefused) {
  START_SERVER(first, standard_args());
  TempDir t;
  std::string log = t.path + "/second.log";
  // (timeout: a server that did start would otherwise run forever)
  std::string cmd = std::string("timeout 20 '") + FLASHMOE_BINARY + "' serve -m '" + source_path("models/coder-mini") +
                    "' --port " + std::to_string(first.port()) + " -t 1 > '" + log + "' 2>&1";
  int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1) << "124: it started and served";
  EXPECT_NE(read_file(log).find("already in use"), std::string::npos) << read_file(log);
  auto c = first.client();
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

// SIGTERM during a streamed and a non-streamed generation: the stream ends
// with an error event (no finish chunk, no [DONE]), the other request gets
// 503, never a 200 with finish_reason "stop"; the process exits 0.
TEST(ServerHardening, ShutdownEndsRequestsWithErrors) {
  auto srv = std::make_unique<ServerProcess>(std::vector<std::string>{"--parallel", "2", "-t", "1"});
  ASSERT_NE(srv->port(), 0) << srv->failure_log();
  json long_gen = {{"prompt", "def main():\n"}, {"max_tokens", 4000}, {"ignore_eos", true}};
  int fd = connect_to(srv->port());
  json streamed = long_gen;
  streamed["stream"] = true;
  std::string b = streamed.dump();
  send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
                   std::to_string(b.size()) + "\r\n\r\n" + b);
  std::string got;
  auto until = Clock::now() + 20s;
  while (got.find("data: ") == std::string::npos && Clock::now() < until) got += read_until_closed(fd, 200ms);
  ASSERT_NE(got.find("data: "), std::string::npos) << got;
  std::optional<http::Response> plain;
  std::thread t([&] {
    auto c = srv->client();
    c.set_read_timeout(30);
    plain = c.Post("/v1/completions", long_gen.dump(), "application/json");
  });
  auto c = srv->client();
  auto deadline = Clock::now() + 10s;
  while (metric(c, "flashmoe_slots_busy") < 2 && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  ASSERT_EQ(metric(c, "flashmoe_slots_busy"), 2);
  pid_t pid = srv->pid();
  kill(pid, SIGTERM);
  bool closed = false;
  got += read_until_closed(fd, 10000ms, &closed);
  close(fd);
  t.join();
  EXPECT_TRUE(closed);
  EXPECT_NE(got.find("\"error\""), std::string::npos) << got.substr(got.size() > 600 ? got.size() - 600 : 0);
  EXPECT_NE(got.find("shutting down"), std::string::npos);
  EXPECT_EQ(got.find("\"finish_reason\":\"stop\""), std::string::npos);
  EXPECT_EQ(got.find("[DONE]"), std::string::npos);
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->status, 503) << plain->body;
  EXPECT_NE(plain->body.find("shutting down"), std::string::npos) << plain->body;
  int status = 0;
  pid_t w = 0;
  for (int i = 0; i < 200 && w == 0; ++i) {
    w = waitpid(pid, &status, WNOHANG);
    if (w == 0) std::this_thread::sleep_for(50ms);
  }
  ASSERT_EQ(w, pid);
  srv->forget();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// SIGTERM and SIGINT end the server promptly (exit 0) at any moment: while
// it loads the model (before it listens), right after its banner, and while
// it holds many connections (idle, kept alive after an answer, halfway
// through a request header). The connections are what made the shutdown
// hang: closing them could drop the last reference to a connection while
// holding the lock its destructor takes (a deadlock: with one connection
// open 1 run in ~30; this test failed 10 runs of 10 on that code).
TEST(ServerHardening, SignalsStopTheServerPromptly) {
  const auto limit = std::chrono::milliseconds(int(3000 * slack()));
  const std::string model = source_path("models/coder-mini");
  TempDir t;
  // Exit 0; or, for a signal that arrives before `serve` has taken SIGINT
  // and SIGTERM over (right after exec), the signal's default action.
  auto expect_clean_exit = [&](pid_t pid, int sig, const std::string& when, const std::function<std::string()>& log) {
    int status = wait_exit(pid, limit);
    if (status == -1) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    bool clean = status != -1 && ((WIFEXITED(status) && WEXITSTATUS(status) == 0) ||
                                  (WIFSIGNALED(status) && WTERMSIG(status) == sig && log().empty()));
    EXPECT_TRUE(clean) << "a signal " << when << ": "
                       << (status == -1 ? "still running after the limit" : "wait status " + std::to_string(status))
                       << "\n" << log();
  };
  int round = 0;
  for (int sig : {SIGTERM, SIGINT}) {
    // Before listen(): during the model load, and right after the banner.
    for (int delay_ms : {0, 40, 120, -1}) {
      std::string log = t.path + "/early" + std::to_string(round++) + ".log";
      pid_t pid = spawn({FLASHMOE_BINARY, "serve", "-m", model, "--port", "0", "-t", "1"}, log);
      if (delay_ms >= 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      else
        for (auto until = Clock::now() + 20s; Clock::now() < until; std::this_thread::sleep_for(1ms))
          if (read_file(log).find("flashmoe serve: model") != std::string::npos) break;
      kill(pid, sig);
      expect_clean_exit(pid, sig, delay_ms >= 0 ? std::to_string(delay_ms) + " ms after the start" : "right after the banner",
                        [&] { return read_file(log); });
    }
    // Listening, with connections in every state a request goes through.
    for (int rep = 0; rep < (sanitizer_build() ? 1 : 2); ++rep) {
      auto srv = std::make_unique<ServerProcess>(std::vector<std::string>{"-t", "1"});
      ASSERT_NE(srv->port(), 0) << srv->failure_log();
      std::vector<int> fds;
      for (int i = 0; i < 48; ++i) {
        int fd = connect_to(srv->port());
        ASSERT_GE(fd, 0);
        fds.push_back(fd);
        if (i % 3 == 1) send_all(fd, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        if (i % 3 == 2) send_all(fd, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ");
      }
      for (int i = 1; i < 48; i += 3) {
        std::string got;
        for (auto until = Clock::now() + 5s; got.find("\r\n\r\n") == std::string::npos && Clock::now() < until;)
          got += read_until_closed(fds[size_t(i)], 20ms);
        ASSERT_EQ(status_of(got), 200) << got;
      }
      pid_t pid = srv->pid();
      kill(pid, sig);
      expect_clean_exit(pid, sig, "with 48 connections open", [&] { return srv->log(); });
      std::string log = srv->log();
      srv->forget();
      EXPECT_EQ(log.find("did not finish"), std::string::npos) << log;
      for (int fd : fds) close(fd);
    }
  }
}

// DNS rebinding and cross-site requests: on a loopback bind a foreign Host
// is refused, and so is any Origin that --cors-origin does not list; the
// ones it lists get CORS headers and a preflight answer.
TEST(ServerHardening, HostAndOriginChecked) {
  START_SERVER(srv, {"-t", "1", "--cors-origin", "http://localhost:3000"});
  auto c = srv.client(false);
  auto r = c.Get("/v1/models", {{"Host", "evil.example:8080"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 403);
  EXPECT_NE(r->body.find("evil.example"), std::string::npos) << r->body;
  r = c.Get("/v1/models", {{"Host", "localhost:8080"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  r = c.Post("/v1/completions", {{"Origin", "https://evil.example"}}, completion().dump(), "text/plain");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 403);
  EXPECT_NE(r->body.find("--cors-origin"), std::string::npos) << r->body;
  r = c.Post("/v1/completions", {{"Origin", "http://localhost:3000"}}, completion().dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), "http://localhost:3000");
  r = c.send("OPTIONS", "/v1/chat/completions",
             {{"Origin", "http://localhost:3000"}, {"Access-Control-Request-Method", "POST"}}, "", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 204);
  EXPECT_NE(r->get_header_value("Access-Control-Allow-Headers").find("Authorization"), std::string::npos);
  r = c.send("OPTIONS", "/v1/chat/completions", {{"Origin", "https://evil.example"}}, "", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 403);
}

// One client's stored conversation never serves another's: a different
// cache_salt, or a different API key, starts from scratch (cached_tokens 0),
// while the same key and salt reuse it.
TEST(ServerHardening, StateCacheIsolatedBySaltAndKey) {
  const std::string other = "second-key-456";
  START_SERVER(srv, {"--api-key", kKey, "--api-key", other, "-t", "1", "-c", "512"});
  auto a = srv.client();
  http::Client b("127.0.0.1", srv.port());
  b.set_default_headers({{"Authorization", "Bearer " + other}});
  std::vector<std::pair<std::string, std::string>> turn = {{"system", "You are a helpful coding assistant."},
                                                           {"user", "Write a function to reverse a string."}};
  json r1 = post_json(a, "/v1/chat/completions", chat_body(turn, 8));
  turn.push_back({"assistant", r1["choices"][0]["message"]["content"]});
  turn.push_back({"user", "Now make it handle None."});
  json next = chat_body(turn, 2);
  auto cached = [](const json& r) { return r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(); };
  EXPECT_EQ(cached(post_json(b, "/v1/chat/completions", next)), 0) << "another key saw the conversation";
  json salted = next;
  salted["cache_salt"] = "tenant-2";
  EXPECT_EQ(cached(post_json(a, "/v1/chat/completions", salted)), 0) << "another salt saw the conversation";
  EXPECT_GT(cached(post_json(a, "/v1/chat/completions", next)), 10) << "the owner's reuse is kept";
  EXPECT_GT(cached(post_json(a, "/v1/chat/completions", salted)), 10) << "the salted request's own reuse";
  // x-api-key (Anthropic's header) is accepted too.
  http::Client x("127.0.0.1", srv.port());
  auto r = x.Get("/v1/models", {{"x-api-key", other}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

// /tokenize and /detokenize give the ids and text of the HF reference
// (tests/fixtures/tokenizers/coder-mini.tokenize_dev.jsonl).
TEST(ServerHardening, TokenizeMatchesReference) {
  START_SERVER(srv, {"-t", "1"});
  auto c = srv.client(false);
  std::ifstream in(source_path("tests/fixtures/tokenizers/coder-mini.tokenize_dev.jsonl"));
  std::string line;
  int rows = 0;
  while (std::getline(in, line) && rows < 40) {
    json row = json::parse(line);
    int st = 0;
    json t = post_json(c, "/tokenize", {{"content", row["text"]}}, &st);
    ASSERT_EQ(st, 200) << t.dump();
    EXPECT_EQ(t["tokens"], row["ids"]) << row["text"];
    json d = post_json(c, "/detokenize", {{"tokens", row["ids"]}}, &st);
    ASSERT_EQ(st, 200) << d.dump();
    EXPECT_EQ(d["content"], row["decoded"]);
    ++rows;
  }
  EXPECT_GE(rows, 10);
  int st = 0;
  json p = post_json(c, "/tokenize", {{"content", "def"}, {"with_pieces", true}}, &st);
  ASSERT_EQ(st, 200);
  EXPECT_EQ(p["tokens"][0]["piece"], "def") << p.dump();
  post_json(c, "/detokenize", {{"tokens", {-1}}}, &st);
  EXPECT_EQ(st, 400);
  post_json(c, "/tokenize", {{"text", "x"}}, &st);
  EXPECT_EQ(st, 400);
}

// A streaming client that stops reading. The tokens go into the socket
// straight from the generating thread while it takes them (server.cpp,
// send_now); once the kernel's buffers are full (up to a few MB on
// loopback) the rest of a chunk waits in an asynchronous write under
// --write-timeout, and when that passes the request is dropped: its slot
// comes back, while the other slot keeps answering. Events with 20
// log-probabilities (~1.6 KB a token) fill the buffers within ~2,600 tokens.
TEST(ServerHardening, StreamNotReadIsDroppedAtTheWriteTimeout) {
  if (sanitizer_build()) GTEST_SKIP() << "~3,000 tokens with log-probabilities: too slow under the sanitizers";
  START_SERVER(srv, {"--parallel", "2", "-t", "2", "--write-timeout", "1", "--max-tokens", "20000"});
  int fd = connect_to(srv.port());
  ASSERT_GE(fd, 0);
  int small = 4096;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  json body = {{"messages", {{{"role", "user"}, {"content", "Write a long story."}}}},
               {"max_tokens", 20000},
               {"ignore_eos", true},
               {"temperature", 0},
               {"stream", true},
               {"logprobs", true},
               {"top_logprobs", 20}};
  std::string b = body.dump();
  ASSERT_TRUE(send_all(fd, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                           "application/json\r\nContent-Length: " +
                               std::to_string(b.size()) + "\r\n\r\n" + b));
  std::string got;
  auto until = Clock::now() + 20s;
  while (got.find("data: ") == std::string::npos && Clock::now() < until) got += read_until_closed(fd, 100ms);
  ASSERT_NE(got.find("data: "), std::string::npos) << got;
  // From here on nothing is read.
  auto c = srv.client();
  c.set_read_timeout(int(30 * slack()));
  int st = 0;
  json other = post_json(c, "/v1/completions", completion(4), &st);
  EXPECT_EQ(st, 200) << other.dump();
  auto deadline = Clock::now() + 60s;
  while (metric(c, "flashmoe_generations_cancelled_total") < 1 && Clock::now() < deadline)
    std::this_thread::sleep_for(100ms);
  EXPECT_EQ(metric(c, "flashmoe_generations_cancelled_total"), 1);
  EXPECT_EQ(metric(c, "flashmoe_slots_busy"), 0);
  close(fd);
}

}  // namespace server_hardening_test
