#include "server/request_guard.h"

#include <algorithm>
#include <cctype>

namespace flashmoe::server {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

// "name:port", "[v6]:port", "name" -> the name (brackets dropped).
std::string host_name(const std::string& host_header) {
  std::string h = lower(host_header);
  if (!h.empty() && h[0] == '[') {
    size_t close = h.find(']');
    return close == std::string::npos ? h : h.substr(1, close - 1);
  }
  size_t colon = h.find(':');
  if (colon != std::string::npos && h.find(':', colon + 1) == std::string::npos) h.resize(colon);
  return h;
}

bool origin_listed(const std::string& origin, const OriginPolicy& p) {
  for (const auto& o : p.cors_origins)
    if (o == "*" || lower(o) == lower(origin)) return true;
  return false;
}

}  // namespace

bool is_loopback_host(const std::string& host) {
  std::string h = host_name(host);
  if (h == "localhost" || h == "::1" || h == "0:0:0:0:0:0:0:1") return true;
  if (h.rfind("127.", 0) != 0) return false;
  // 127.a.b.c with digits only (not a name such as 127.evil.example).
  int dots = 0;
  for (char c : h) {
    if (c == '.') ++dots;
    else if (!std::isdigit((unsigned char)c)) return false;
  }
  return dots == 3;
}

std::optional<std::string> refuse_host_or_origin(const HttpRequest& req, const OriginPolicy& p) {
  if (is_loopback_host(p.bound_host) && req.has_header("Host")) {
    std::string host = req.header("Host");
    if (!is_loopback_host(host))
      return "the Host header '" + host + "' does not name this server's loopback address; requests through " +
             "another name are refused (DNS rebinding protection; bind with --host to serve other names)";
  }
  if (!req.has_header("Origin")) return std::nullopt;
  std::string origin = req.header("Origin");
  if (origin_listed(origin, p)) return std::nullopt;
  // A page the server itself would have served (it serves none today).
  if (req.has_header("Host") && lower(origin) == "http://" + lower(req.header("Host"))) return std::nullopt;
  return "cross-origin requests from '" + origin + "' are refused; start the server with --cors-origin " +
         (origin == "null" ? std::string("'*'") : origin) + " to allow them";
}

std::string cors_allow_origin(const HttpRequest& req, const OriginPolicy& p) {
  if (!req.has_header("Origin")) return "";
  std::string origin = req.header("Origin");
  return origin_listed(origin, p) ? origin : "";
}

}  // namespace flashmoe::server
