// The server's API, independent of the HTTP transport: routes a request
// (method, path, headers, body) to its handler and returns the response or
// a stream (http_exchange.h). Owns the slots, the state cache and the
// metrics. The transport (server.cpp) calls handle() from its worker
// threads; everything here is thread-safe.
#pragma once
#include <atomic>
#include <memory>
#include <string>

#include "server/http_exchange.h"
#include "server/server.h"

namespace flashmoe::server {

class ApiRoutes {
 public:
  ApiRoutes(const ServerConfig& cfg, const ServedModel& model);
  ~ApiRoutes();

  // Answers one request; may run a whole generation (non-streamed) before
  // returning. Never throws: every failure is an error response.
  HttpResponse handle(const HttpRequest& req);
  // Whether handle() answers this request without waiting for a slot or the
  // model (health, metrics, models): the transport may run it on its I/O
  // threads, so those stay answerable when every worker is busy.
  bool answers_at_once(const HttpRequest& req) const;

  // The same JSON error shape for statuses the transport produces itself
  // (413, 431, 408, 400 for a malformed request).
  static HttpResponse error_response(int status, const std::string& message);
  // Counts a finished request in /metrics and the access log.
  void record(const std::string& method, const std::string& path, int status);

  // Cancels running generations and refuses queued and new ones.
  void stop();
  bool stopping() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashmoe::server
