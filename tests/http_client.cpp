#include "http_client.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace flashmoe::test::http {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;

std::string Response::get_header_value(const std::string& name) const {
  for (const auto& [k, v] : headers)
    if (beast::iequals(k, name)) return v;
  return "";
}

std::optional<Response> Client::send(const std::string& method, const std::string& path, const Headers& extra,
                                     const std::string& body, const std::string& content_type) {
  net::io_context ioc;
  beast::tcp_stream stream(ioc);
  bhttp::request<bhttp::string_body> req{bhttp::string_to_verb(method), path, 11};
  req.set(bhttp::field::host, host_ + ":" + std::to_string(port_));
  for (const auto& [k, v] : default_headers_) req.set(k, v);
  for (const auto& [k, v] : extra) req.set(k, v);
  if (!content_type.empty()) req.set(bhttp::field::content_type, content_type);
  req.body() = body;
  if (method != "GET" || !body.empty()) req.prepare_payload();
  beast::flat_buffer buf;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(boost::none);
  bool ok = false;
  stream.expires_after(timeout_);
  net::ip::tcp::endpoint ep(net::ip::make_address(host_), uint16_t(port_));
  // Reads while it writes: a server may answer (413, say) before it has
  // read the whole body.
  stream.async_connect(ep, [&](beast::error_code ec) {
    if (ec) return;
    bhttp::async_write(stream, req, [](beast::error_code, size_t) {});
    bhttp::async_read(stream, buf, parser, [&](beast::error_code ec, size_t) {
      ok = !ec;
      stream.socket().close(ec);
    });
  });
  ioc.run();
  if (!ok) return std::nullopt;
  Response r;
  r.status = int(parser.get().result_int());
  r.body = std::move(parser.get().body());
  for (const auto& f : parser.get()) r.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
  return r;
}

}  // namespace flashmoe::test::http
