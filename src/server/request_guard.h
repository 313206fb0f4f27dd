// Which browsers may talk to the server. A server on loopback without an API
// key trusts everything that reaches it, and a web page can reach it: by
// fetch() from any site (cross-origin "simple" requests are sent without a
// preflight), or by DNS rebinding (a site's name re-pointed at 127.0.0.1,
// so the page is same-origin with the server). So, as Jupyter does: on a
// loopback bind the Host header must name a loopback address, and a
// request that carries an Origin (every cross-origin browser request does;
// curl and the SDKs send none) is refused unless --cors-origin allows it.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "server/http_exchange.h"

namespace flashmoe::server {

struct OriginPolicy {
  std::string bound_host;                 // --host
  std::vector<std::string> cors_origins;  // --cors-origin values; "*" allows any
};

// Why the request is refused (a 403 message naming the Host or Origin), or
// nullopt when it may go on.
std::optional<std::string> refuse_host_or_origin(const HttpRequest& req, const OriginPolicy& p);

// The Access-Control-Allow-Origin value for an allowed cross-origin request
// ("" when the request has no Origin or CORS is off).
std::string cors_allow_origin(const HttpRequest& req, const OriginPolicy& p);

// Whether `host` (an address or "localhost") is a loopback address.
bool is_loopback_host(const std::string& host);

}  // namespace flashmoe::server
