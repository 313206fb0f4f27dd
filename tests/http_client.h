// A small blocking HTTP/1.1 client for the server tests (Boost.Beast), one
// connection per request, with a deadline for the whole exchange. Its
// Get/Post take the shapes the tests used with cpp-httplib's client. Beast
// stays in http_client.cpp: its headers and the instantiated operations
// cost each including file several seconds of compile time (twice in
// `make test`: the Release and the sanitizer builds).
#pragma once
#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flashmoe::test::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Response {
  int status = 0;
  std::string body;
  Headers headers;
  // The first header of that name (case-insensitive), or "".
  std::string get_header_value(const std::string& name) const;
};

class Client {
 public:
  Client(std::string host, int port) : host_(std::move(host)), port_(port) {}
  void set_read_timeout(int seconds, int /*microseconds*/ = 0) { timeout_ = std::chrono::seconds(seconds); }
  void set_default_headers(Headers h) { default_headers_ = std::move(h); }

  std::optional<Response> Get(const std::string& path, const Headers& extra = {}) {
    return send("GET", path, extra, "", "");
  }
  std::optional<Response> Post(const std::string& path, const std::string& body, const std::string& content_type) {
    return send("POST", path, {}, body, content_type);
  }
  std::optional<Response> Post(const std::string& path, const Headers& extra, const std::string& body,
                               const std::string& content_type) {
    return send("POST", path, extra, body, content_type);
  }
  std::optional<Response> send(const std::string& method, const std::string& path, const Headers& extra,
                               const std::string& body, const std::string& content_type);

 private:
  std::string host_;
  int port_;
  std::chrono::steady_clock::duration timeout_ = std::chrono::seconds(120);
  Headers default_headers_;
};

}  // namespace flashmoe::test::http
