// The server's request validation. The first byte picks what the rest is:
// bit 1 clear: an HTTP body, bit 0 choosing chat or completions; bit 1 set:
// the Host, Origin and bound host (newline-separated) of the Host/Origin
// check.
#include "server/openai_api.h"
#include "server/request_guard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] & 2) {
    std::string parts[3];
    size_t at = 0;
    for (int i = 0; i < 3; ++i) {
      size_t nl = body.find('\n', at);
      parts[i] = body.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
      at = nl == std::string::npos ? body.size() : nl + 1;
    }
    flashmoe::server::HttpRequest req;
    req.headers = {{"Host", parts[0]}, {"Origin", parts[1]}};
    flashmoe::server::OriginPolicy p{parts[2], {parts[1].substr(0, parts[1].size() / 2)}};
    flashmoe::server::refuse_host_or_origin(req, p);
    flashmoe::server::cors_allow_origin(req, p);
    flashmoe::server::is_loopback_host(parts[0]);
    return 0;
  }
  try {
    flashmoe::server::parse_completion_request(body, data[0] & 1);
  } catch (const flashmoe::server::ApiError& e) {
    flashmoe::server::error_body(e);
  }
  return 0;
}
