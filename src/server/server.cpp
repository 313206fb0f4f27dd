// The HTTP transport: Boost.Beast over Asio. A few I/O threads run every
// socket asynchronously (accept, read, write), so a connection that is slow
// or idle costs a socket and a buffer, not a thread; a request, once read
// whole within its deadline and limits, goes to a worker thread for the API
// (api_routes.cpp), which may generate for a long time. Why Beast, and the
// limits: docs/server.md.
#include "server/server.h"

#include <poll.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <memory>
#include <unordered_set>
#include <vector>

#include "core/error.h"
#include "server/api_routes.h"

namespace flashmoe::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

constexpr int kIoThreads = 2;
constexpr int kIoNice = 10;

}  // namespace

class Connection;

struct Transport {
  ServerConfig cfg;
  ApiRoutes api;
  std::atomic<bool> stopping{false};
  std::atomic<bool> failed{false};

  // Requests handed to the API and not yet answered completely: shutdown
  // waits for them (they end quickly once the API is stopped).
  std::mutex busy_mu;
  std::condition_variable busy_cv;
  int busy = 0;
  // Open connections, so that shutdown can close the idle ones.
  std::mutex conns_mu;
  std::unordered_set<Connection*> conns;
  // Declared last, destroyed first: handlers still queued in the I/O context
  // hold connections, whose destructors use the members above.
  net::io_context ioc;
  // Keeps run() going while no operation is pending (a worker generating
  // between two writes, after the acceptor closed); dropped at the end of
  // stop().
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  tcp::acceptor acceptor{ioc};
  std::optional<net::thread_pool> workers;

  Transport(ServerConfig c, const ServedModel& model) : cfg(std::move(c)), api(cfg, model) {}

  void accept();
  void begin_request() {
    std::lock_guard<std::mutex> l(busy_mu);
    ++busy;
  }
  void end_request() {
    std::lock_guard<std::mutex> l(busy_mu);
    if (--busy == 0) busy_cv.notify_all();
  }
};

// One client connection: reads requests one at a time (HTTP/1.1 keep-alive),
// each within an absolute deadline and the size limits, answers it, reads the
// next. Lives as long as an asynchronous operation or a worker holds it.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // The read buffer holds at most a header and 64 KiB more: a body is moved
  // out of it as it is parsed, so only a chunk-size line that never ends
  // (chunk extensions) could grow it, and that is a 400.
  Connection(Transport& srv, tcp::socket socket)
      : srv_(srv), stream_(std::move(socket)), buffer_(srv.cfg.max_header_bytes + (64 << 10)) {
    std::lock_guard<std::mutex> l(srv_.conns_mu);
    srv_.conns.insert(this);
  }
  ~Connection() {
    std::lock_guard<std::mutex> l(srv_.conns_mu);
    srv_.conns.erase(this);
  }

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_request(); });
  }

  // From shutdown: a connection waiting for a request is closed; one whose
  // request is being answered finishes that answer first, unless `force`.
  void close_if_idle(bool force) {
    net::post(stream_.get_executor(), [self = shared_from_this(), force] {
      if (force || !self->answering_) self->close();
    });
  }

 private:
  const ServerConfig& cfg() const { return srv_.cfg; }

  void read_request() {
    if (srv_.stopping) return close();
    parser_.emplace();
    parser_->header_limit(std::uint32_t(cfg().max_header_bytes));
    parser_->body_limit(std::uint64_t(cfg().max_body));
    // One deadline for the whole request, headers and body: it is not
    // renewed by each byte, so a client that trickles cannot keep the
    // connection (and the memory of its request) forever.
    stream_.expires_after(std::chrono::milliseconds(cfg().read_timeout_ms));
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return read_failed(ec);
    const auto& h = parser_->get();
    size_t fields = size_t(std::distance(h.begin(), h.end()));
    if (fields > cfg().max_header_fields)
      return refuse(431, "the request has " + std::to_string(fields) + " header fields; this server's limit is " +
                             std::to_string(cfg().max_header_fields));
    if (beast::iequals(h[http::field::expect], "100-continue")) {
      auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_, h.version());
      http::async_write(stream_, *cont, [self = shared_from_this(), cont](beast::error_code ec, size_t) {
        if (ec) return self->close();
        self->read_body();
      });
      return;
    }
    read_body();
  }

  void read_body() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_request(ec); });
  }

  void read_failed(beast::error_code ec) {
    if (ec == http::error::body_limit)
      return refuse(413, "the request body is larger than this server's limit of " + std::to_string(cfg().max_body) +
                             " bytes (--max-body)");
    if (ec == http::error::buffer_overflow)
      return refuse(400, "malformed HTTP request (a chunk-size line longer than 64 KiB)");
    if (ec == http::error::header_limit)
      return refuse(431, "the request's header is larger than this server's limit of " +
                             std::to_string(cfg().max_header_bytes) + " bytes");
    if (ec == beast::error::timeout) {
      if (parser_ && parser_->got_some())
        return refuse(408, "the request was not received within " + std::to_string(cfg().read_timeout_ms) +
                               " ms (--read-timeout)");
      return close();
    }
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::operation_aborted ||
        ec == net::error::connection_reset || !parser_ || !parser_->got_some())
      return close();
    // A malformed request line, header or chunk.
    return refuse(400, "malformed HTTP request (" + ec.message() + ")");
  }

  void on_request(beast::error_code ec) {
    if (ec) return read_failed(ec);
    auto& m = parser_->get();
    auto req = std::make_shared<HttpRequest>();
    req->method = std::string(m.method_string());
    std::string_view target(m.target().data(), m.target().size());
    size_t q = target.find('?');
    req->path = std::string(target.substr(0, q));
    if (q != std::string_view::npos) req->query = std::string(target.substr(q + 1));
    for (const auto& f : m) req->headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    req->body = std::move(m.body());
    keep_alive_ = m.keep_alive();
    version_ = m.version();
    head_only_ = m.method() == http::verb::head;
    parser_.reset();
    answering_ = true;
    stream_.expires_never();
    if (srv_.api.answers_at_once(*req)) {
      answer(srv_.api.handle(*req), *req);
      return;
    }
    srv_.begin_request();
    net::post(*srv_.workers, [self = shared_from_this(), req] {
      HttpResponse res = self->srv_.api.handle(*req);
      if (res.stream) self->stream_response(res, *req);
      else
        net::dispatch(self->stream_.get_executor(), [self, req, res = std::move(res)]() mutable {
          self->answer(std::move(res), *req);
        });
      self->srv_.end_request();
    });
  }

  // A status the transport decides by itself; the connection closes after it
  // (the rest of the request is not read).
  void refuse(int status, const std::string& message) {
    keep_alive_ = false;
    unread_ = true;
    version_ = 11;
    answering_ = true;
    HttpRequest none;
    none.method = parser_ ? std::string(parser_->get().method_string()) : "";
    none.path = parser_ ? std::string(parser_->get().target()) : "";
    parser_.reset();
    answer(ApiRoutes::error_response(status, message), none);
  }

  // Writes a whole response (on the connection's strand).
  void answer(HttpResponse res, const HttpRequest& req) {
    srv_.api.record(req.method, req.path, res.status);
    auto msg = std::make_shared<http::response<http::string_body>>(http::int_to_status(unsigned(res.status)), version_);
    msg->set(http::field::server, "flashmoe");
    msg->set(http::field::content_type, res.content_type);
    for (const auto& [k, v] : res.headers) msg->set(k, v);
    msg->keep_alive(keep_alive_ && !srv_.stopping);
    msg->body() = std::move(res.body);
    msg->prepare_payload();
    if (head_only_) msg->body().clear();
    stream_.expires_after(std::chrono::milliseconds(cfg().write_timeout_ms));
    http::async_write(stream_, *msg, [self = shared_from_this(), msg](beast::error_code ec, size_t) {
      self->answering_ = false;
      if (!ec && self->unread_) return self->linger_close();
      if (ec || !msg->keep_alive()) return self->close();
      self->read_request();
    });
  }

  // Runs on a worker: the headers, then each chunk the API's stream writes,
  // each write waited for (so the generation goes at the client's pace and
  // stops when the client has gone or does not read within the write
  // timeout).
  void stream_response(HttpResponse& res, const HttpRequest& req) {
    srv_.api.record(req.method, req.path, res.status);
    auto head = std::make_shared<http::response<http::empty_body>>(http::int_to_status(unsigned(res.status)), version_);
    head->set(http::field::server, "flashmoe");
    head->set(http::field::content_type, res.content_type);
    for (const auto& [k, v] : res.headers) head->set(k, v);
    head->chunked(true);
    head->keep_alive(keep_alive_);
    bool ok = wait_for([this, head](auto done) {
      auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*head);
      http::async_write_header(stream_, *sr, [sr, done](beast::error_code ec, size_t) { done(ec); });
    });
    struct Sink : EventSink {
      Connection* c;
      bool ok;
      bool gone() override { return !ok || c->peer_gone(); }
      // One chunk of the chunked body (RFC 9112, 7.1): its size in hex, CRLF,
      // the bytes, CRLF. Sent from this thread while the socket takes it
      // (the usual case: the client reads as fast as tokens come); what the
      // socket does not take at once goes through the I/O thread's
      // asynchronous write under the write timeout. A hand-off to the I/O
      // thread and back for every token cost the GPU server 2-5% of its
      // tokens/s (bench/NOTES.md, "Session 19").
      bool write(std::string_view chunk) override {
        if (!ok) return false;
        if (chunk.empty()) return true;
        char size[24];
        const int n = std::snprintf(size, sizeof size, "%zx\r\n", chunk.size());
        auto data = std::make_shared<std::string>();
        data->reserve(size_t(n) + chunk.size() + 2);
        data->append(size, size_t(n)).append(chunk).append("\r\n");
        const std::optional<size_t> sent = c->send_now(*data);
        if (!sent) return ok = false;
        if (*sent == data->size()) return true;
        data->erase(0, *sent);
        ok = c->wait_for([c = c, data](auto done) {
          net::async_write(c->stream_, net::buffer(*data), [data, done](beast::error_code ec, size_t) { done(ec); });
        });
        return ok;
      }
    } sink;
    sink.c = this;
    sink.ok = ok;
    res.stream(sink);
    ok = sink.ok && wait_for([this](auto done) {
      net::async_write(stream_, http::make_chunk_last(), [done](beast::error_code ec, size_t) { done(ec); });
    });
    net::dispatch(stream_.get_executor(), [self = shared_from_this(), ok, keep = head->keep_alive()] {
      self->answering_ = false;
      if (!ok || !keep || self->srv_.stopping) return self->close();
      self->read_request();
    });
  }

  // From the worker that streams an answer, while no asynchronous operation
  // of this connection is pending (each of its writes is waited for): sends
  // what the socket takes without blocking. The bytes sent (possibly fewer
  // than asked, or 0), or none when the connection failed or was closed
  // (close() takes socket_mu_ too, so the descriptor is never one reused
  // after closing).
  std::optional<size_t> send_now(std::string_view bytes) {
    std::lock_guard<std::mutex> l(socket_mu_);
    if (closed_) return std::nullopt;
    const int fd = stream_.socket().native_handle();
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        done += size_t(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        return std::nullopt;  // reset, broken pipe
      }
    }
    return done;
  }

  // Whether the peer closed its connection (its FIN or a reset), seen by
  // poll() without reading from it, which the I/O threads own. A client
  // that half-closes after its request (no HTTP client we know does) would
  // look gone too.
  bool peer_gone() {
    std::lock_guard<std::mutex> l(socket_mu_);
    if (closed_) return true;
    pollfd p{stream_.socket().native_handle(), POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
  }

  // Starts an asynchronous write on the connection's strand and blocks this
  // (worker) thread until it completes or the write timeout passes.
  template <class Start>
  bool wait_for(Start start) {
    auto p = std::make_shared<std::promise<bool>>();
    auto f = p->get_future();
    // The operation holds the connection, so it may outlive this wait.
    net::dispatch(stream_.get_executor(), [self = shared_from_this(), p, start] {
      self->stream_.expires_after(std::chrono::milliseconds(self->cfg().write_timeout_ms));
      start([p, self](beast::error_code ec) { p->set_value(!ec); });
    });
    // A backstop past the write deadline, in case the I/O threads stopped.
    if (f.wait_for(std::chrono::milliseconds(cfg().write_timeout_ms) + std::chrono::seconds(2)) !=
        std::future_status::ready)
      return false;
    return f.get();
  }

  // After refusing a request whose rest was not read: stop sending, then
  // read and drop what the client still sends, briefly, before closing.
  // Closing with unread data would reset the connection, and the client
  // could lose the answer (the 413 it is meant to read).
  void linger_close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.expires_after(std::chrono::milliseconds(500));
    drain_.resize(64 << 10);
    drain();
  }
  void drain() {
    stream_.async_read_some(net::buffer(drain_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->drained_ += n;
      if (ec || self->drained_ > (size_t(64) << 20)) return self->close();
      self->drain();
    });
  }

  void close() {
    std::lock_guard<std::mutex> l(socket_mu_);
    closed_ = true;
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.close();
  }

  Transport& srv_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool keep_alive_ = true, head_only_ = false, answering_ = false, unread_ = false;
  std::vector<char> drain_;
  size_t drained_ = 0;
  unsigned version_ = 11;
  std::mutex socket_mu_;  // send_now / peer_gone (a worker) against close()
  bool closed_ = false;
};

struct HttpServer::Impl : Transport {
  using Transport::Transport;
};

void Transport::accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) {
      // Each streamed token leaves at once, not held back until the
      // previous one is acknowledged (Nagle's algorithm).
      beast::error_code nodelay_ec;
      socket.set_option(tcp::no_delay(true), nodelay_ec);
      std::make_shared<Connection>(*this, std::move(socket))->start();
      accept();
      return;
    }
    // Out of file descriptors, say: try again shortly rather than spin.
    auto t = std::make_shared<net::steady_timer>(ioc, std::chrono::milliseconds(50));
    t->async_wait([this, t](beast::error_code) { accept(); });
  });
}

HttpServer::HttpServer(ServerConfig cfg, ServedModel model) : impl_(std::make_unique<Impl>(std::move(cfg), model)) {}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  auto& c = impl_->cfg;
  auto where = [&] { return c.host + ":" + std::to_string(c.port); };
  beast::error_code ec;
  tcp::endpoint ep;
  net::ip::address addr = net::ip::make_address(c.host, ec);
  if (!ec) {
    ep = tcp::endpoint(addr, uint16_t(c.port));
  } else {  // a name (localhost, the machine's name): its first address
    tcp::resolver resolver(impl_->ioc);
    auto found = resolver.resolve(c.host, std::to_string(c.port), ec);
    if (ec || found.empty()) fail("cannot listen on " + where() + ": the host name '" + c.host + "' does not resolve");
    ep = found.begin()->endpoint();
  }
  auto& a = impl_->acceptor;
  a.open(ep.protocol(), ec);
  // SO_REUSEADDR only lets a restarted server bind past connections in
  // TIME_WAIT; without SO_REUSEPORT a second server on a port in use fails
  // here instead of silently sharing the traffic.
  if (!ec) a.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (ec == net::error::address_in_use)
    fail("cannot listen on " + where() + ": the address is already in use (is another server running there?)");
  if (!ec) a.listen(net::socket_base::max_listen_connections, ec);
  if (ec) fail("cannot listen on " + where() + ": " + ec.message());
  return a.local_endpoint().port();
}

bool HttpServer::listen() {
  auto& s = *impl_;
  s.workers.emplace(size_t(s.cfg.parallel + s.cfg.queue + 4));  // generating + waiting + the rest
  s.work.emplace(s.ioc.get_executor());
  s.accept();
  // The I/O threads yield the CPU to generation (nice +kIoNice): under a
  // flood of hostile connections the well-behaved requests' tokens keep
  // their pace, and parsing waits instead (bench/NOTES.md, "Hostile clients").
  auto run_io = [&s] {
    setpriority(PRIO_PROCESS, pid_t(syscall(SYS_gettid)), kIoNice);
    s.ioc.run();
  };
  std::vector<std::thread> io;
  for (int i = 1; i < kIoThreads; ++i) io.emplace_back(run_io);
  run_io();
  for (auto& t : io) t.join();
  s.workers->join();
  return !s.failed;
}

void HttpServer::stop() {
  auto& s = *impl_;
  if (s.stopping.exchange(true)) return;
  // New connections are refused; running generations end (streams with an
  // error event, others with 503) and queued requests get 503.
  net::post(s.ioc, [&s] {
    beast::error_code ec;
    s.acceptor.close(ec);
  });
  s.api.stop();
  {
    std::unique_lock<std::mutex> l(s.busy_mu);
    s.busy_cv.wait_for(l, std::chrono::seconds(10), [&s] { return s.busy == 0; });
  }
  auto close_all = [&s](bool force) {
    std::vector<std::shared_ptr<Connection>> open;
    {
      std::lock_guard<std::mutex> l(s.conns_mu);
      for (Connection* c : s.conns)
        if (auto p = c->weak_from_this().lock()) open.push_back(std::move(p));  // null: being destroyed
    }
    // Outside conns_mu: once the I/O thread has closed a connection, the
    // reference held here can be its last, and its destructor takes
    // conns_mu (destroying it under the lock was the shutdown deadlock).
    for (auto& c : open) c->close_if_idle(force);
  };
  close_all(false);
  // Let the last answers be written, then close what is left (a client
  // that does not read) and end the I/O threads.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  close_all(true);
  auto t = std::make_shared<net::steady_timer>(s.ioc, std::chrono::milliseconds(100));
  t->async_wait([&s, t](beast::error_code) {
    s.work.reset();
    s.ioc.stop();
  });
}

}  // namespace flashmoe::server
