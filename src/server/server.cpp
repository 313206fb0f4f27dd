// The HTTP transport: cpp-httplib under the API handlers of api_routes.cpp.
#include "server/server.h"

#include <httplib.h>

#include "core/error.h"
#include "server/api_routes.h"

namespace flashmoe::server {

namespace {

HttpRequest to_request(const httplib::Request& r) {
  HttpRequest q;
  q.method = r.method;
  q.path = r.path;
  for (const auto& [k, v] : r.headers) q.headers.emplace_back(k, v);
  q.body = r.body;
  return q;
}

class ChunkSink : public EventSink {
 public:
  explicit ChunkSink(httplib::DataSink& s) : s_(s) {}
  bool write(std::string_view chunk) override { return s_.is_writable() && s_.write(chunk.data(), chunk.size()); }

 private:
  httplib::DataSink& s_;
};

void apply(const HttpResponse& a, httplib::Response& res) {
  res.status = a.status;
  for (const auto& [k, v] : a.headers) res.set_header(k.c_str(), v);
  if (!a.stream) {
    res.set_content(a.body, a.content_type.c_str());
    return;
  }
  auto stream = a.stream;
  auto used = std::make_shared<bool>(false);
  res.set_chunked_content_provider(a.content_type.c_str(), [stream, used](size_t, httplib::DataSink& sink) {
    if (*used) return false;  // a second call: the stream already ended
    *used = true;
    ChunkSink s(sink);
    stream(s);
    sink.done();
    return true;
  });
}

}  // namespace

struct HttpServer::Impl {
  ServerConfig cfg;
  ApiRoutes api;
  httplib::Server svr;

  Impl(ServerConfig c, const ServedModel& model) : cfg(std::move(c)), api(cfg, model) {}

  void setup() {
    int threads = cfg.parallel + cfg.queue + 8;  // generating + waiting + cheap endpoints
    svr.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    svr.set_payload_max_length(cfg.max_body);
    svr.set_keep_alive_timeout(2);
    svr.set_read_timeout(30);
    svr.set_write_timeout(30);
    auto handler = [this](const httplib::Request& req, httplib::Response& res) { apply(api.handle(to_request(req)), res); };
    for (const char* re : {R"(/.*)"}) {
      svr.Get(re, handler);
      svr.Post(re, handler);
    }
    // Statuses httplib sets by itself (413, 400 for a bad request line)
    // get the same JSON error shape as ours.
    svr.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request&, httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string msg = "bad request";
      if (res.status == 404) msg = "not found";
      else if (res.status == 405) msg = "method not allowed";
      else if (res.status == 413) msg = "the request body is larger than this server's limit of " + std::to_string(cfg.max_body) + " bytes";
      else if (res.status >= 500) msg = "internal error";
      apply(ApiRoutes::error_response(res.status, msg), res);
      return httplib::Server::HandlerResponse::Handled;
    }));
    svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
      apply(ApiRoutes::error_response(500, "internal error"), res);
    });
    svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      api.record(req.method, req.path, res.status);
    });
  }
};

HttpServer::HttpServer(ServerConfig cfg, ServedModel model) : impl_(std::make_unique<Impl>(std::move(cfg), model)) {
  impl_->setup();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  auto& c = impl_->cfg;
  int port = c.port;
  if (port == 0) port = impl_->svr.bind_to_any_port(c.host);
  else if (!impl_->svr.bind_to_port(c.host, port)) port = -1;
  if (port <= 0) fail("cannot listen on " + c.host + ":" + std::to_string(c.port) + " (address in use or not available)");
  return port;
}

bool HttpServer::listen() { return impl_->svr.listen_after_bind(); }

void HttpServer::stop() {
  impl_->api.stop();
  impl_->svr.stop();
}

}  // namespace flashmoe::server
