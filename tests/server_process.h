// A real `flashmoe serve` child process for the end-to-end tests
// (server_e2e_test.cpp, and CudaServe in cuda_serve_test.cpp), and the
// small HTTP helpers they share.
#pragma once
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
#include <string>
#include <thread>
#include <vector>

#include "http_client.h"
#include "test_util.h"

namespace flashmoe::test::serve {

using json = nlohmann::json;
using namespace std::chrono_literals;

inline const std::string kKey = "test-key-123";

// Runs args[0] with args as a child process, stdout and stderr to `log`.
inline pid_t spawn(std::vector<std::string> args, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// The child's wait status once it exits, or -1 if it is still running after
// `timeout` (it is then left running).
inline int wait_exit(pid_t pid, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(10ms);
  }
}

// ServerProcess's model when `extra` names the model itself (--synthetic): no -m.
inline const std::string kNoModel = "(none)";

// One `flashmoe serve` child process on a random free high port, serving
// models/coder-mini unless given another model directory (or kNoModel).
class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> extra, std::string model = "") {
    if (model.empty()) model = source_path("models/coder-mini");
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 8 && port_ == 0; ++attempt) {
      int port = 20000 + int(rng() % 40000);
      std::string log = dir_.path + "/serve.log";
      std::vector<std::string> args = {FLASHMOE_BINARY, "serve", "--port", std::to_string(port)};
      if (model != kNoModel) args.insert(args.end(), {"-m", model});
      args.insert(args.end(), extra.begin(), extra.end());
      pid_ = spawn(args, log);
      // Ours once it printed its banner (after binding), not merely when
      // something answers on the port.
      auto deadline = std::chrono::steady_clock::now() + 60s;
      while (std::chrono::steady_clock::now() < deadline) {
        int status = 0;
        if (waitpid(pid_, &status, WNOHANG) == pid_) {
          pid_ = -1;
          break;  // exited: port taken (or a real failure, shown by the log)
        }
        if (read_file(log).find("flashmoe serve: model") != std::string::npos) {
          http::Client c("127.0.0.1", port);
          auto r = c.Get("/health");
          if (r && r->status == 200) {
            port_ = port;
            break;
          }
        }
        std::this_thread::sleep_for(50ms);
      }
      if (port_ == 0) last_log_ = read_file(log);
    }
  }
  ~ServerProcess() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    if (wait_exit(pid_, 10s) != -1) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }
  const std::string& failure_log() const { return last_log_; }
  std::string log() const { return read_file(dir_.path + "/serve.log"); }  // stderr and stdout so far
  pid_t pid() const { return pid_; }
  void forget() { pid_ = -1; }  // the caller reaped the process

  http::Client client(bool with_key = true) const {
    http::Client c("127.0.0.1", port_);
    c.set_read_timeout(120, 0);
    if (with_key) c.set_default_headers({{"Authorization", "Bearer " + kKey}});
    return c;
  }

 private:
  TempDir dir_;
  pid_t pid_ = -1;
  int port_ = 0;
  std::string last_log_;
};

// A raw loopback socket to `port`, for what the HTTP client cannot do
// (disconnect mid-stream, trickle bytes, send malformed requests); -1 if the
// connection is refused.
inline int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The usual server for these tests: 4 slots, API key, small limits.
inline std::vector<std::string> standard_args() {
  return {"--api-key", kKey, "--parallel", "4", "--queue", "16", "--max-body", "65536", "-c", "512", "-t", "2"};
}

inline json post_json(http::Client& c, const std::string& path, const json& body, int* status = nullptr) {
  auto r = c.Post(path, body.dump(), "application/json");
  if (!r) {
    ADD_FAILURE() << "no response from " << path;
    return json();
  }
  if (status) *status = r->status;
  return json::parse(r->body, nullptr, false);
}

inline json chat_body(const std::vector<std::pair<std::string, std::string>>& msgs, int max_tokens = 16) {
  json m = json::array();
  for (auto& [role, content] : msgs) m.push_back({{"role", role}, {"content", content}});
  return {{"model", "coder-mini"}, {"messages", m}, {"max_tokens", max_tokens}, {"temperature", 0}};
}

inline int64_t metric(http::Client& c, const std::string& name) {
  auto r = c.Get("/metrics");
  if (!r) return -1;
  std::smatch m;
  std::regex re("(^|\n)" + name + " ([0-9.e+]+)");
  if (!std::regex_search(r->body, m, re)) return -1;
  return int64_t(std::stod(m[2].str()));
}

}  // namespace flashmoe::test::serve

#define START_SERVER(var, ...)                                            \
  ServerProcess var(__VA_ARGS__);                                         \
  ASSERT_NE(var.port(), 0) << "server did not start:\n" << var.failure_log()
