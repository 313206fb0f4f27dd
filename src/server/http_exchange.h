// The boundary between the HTTP transport (server.cpp) and the API handlers
// (api_routes.cpp): a request as plain data, and a response that is either
// a whole body or a stream of chunks written through an EventSink. Nothing
// here names an HTTP library, so handlers are added and tested without one.
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flashmoe::server {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // without the query
  std::string query;   // after '?', undecoded; empty when none
  std::vector<std::pair<std::string, std::string>> headers;  // in arrival order
  std::string body;
  // The first header of that name (case-insensitive), or "" when absent.
  std::string header(std::string_view name) const;
  bool has_header(std::string_view name) const;
};

// Where a streamed response's chunks go. write() blocks until the chunk is
// handed to the connection; false when the client has gone (or did not read
// in time): the handler then stops producing.
class EventSink {
 public:
  virtual ~EventSink() = default;
  virtual bool write(std::string_view chunk) = 0;
  // Whether the client has visibly gone (closed its connection) although no
  // write has failed yet: asked while a long prompt is read, before there is
  // anything to write, so that its slot comes back within a step.
  virtual bool gone() { return false; }
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers
  std::string body;
  // Set for a streamed answer (server-sent events): the transport sends the
  // status and headers, then runs `stream` with a sink for the body, on a
  // worker thread; the response ends when it returns.
  std::function<void(EventSink&)> stream;
};

}  // namespace flashmoe::server
