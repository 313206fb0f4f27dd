// The server's handling of untrusted text: request bodies, Host/Origin
// headers and model output. The first byte picks what the rest is:
// 'A' an Anthropic Messages body; 'O' generated text for the chat output
// parser (reasoning / tool calls, fed in pieces of 1..8 bytes chosen by the
// next byte, with the Anthropic response builder on its events); otherwise
// bit 1 clear: an OpenAI HTTP body, bit 0 choosing chat or completions;
// bit 1 set: the Host, Origin and bound host (newline-separated) of the
// Host/Origin check.
#include "server/anthropic_api.h"
#include "server/chat_output.h"
#include "server/openai_api.h"
#include "server/request_guard.h"

using flashmoe::server::ApiError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] == 'A') {
    try {
      flashmoe::server::parse_anthropic_request(body);
    } catch (const ApiError& e) {
      flashmoe::server::anthropic_error_body(e.status, e.what());
    }
    return 0;
  }
  if (data[0] == 'O') {
    const auto tools = nlohmann::ordered_json::parse(
        R"([{"type":"function","function":{"name":"f","parameters":{"properties":{"n":{"type":"integer"}}}}}])");
    const unsigned char opt = body.empty() ? 0 : (unsigned char)body[0];
    flashmoe::server::ChatOutputParser p({(opt & 8) != 0, true, tools});
    flashmoe::server::AnthropicMessageBuilder b("msg", "m", 1);
    const size_t step = 1 + (opt & 7);
    for (size_t i = 0; i < body.size(); i += step) b.add(p.feed(body.substr(i, step)));
    b.add(p.finish());
    b.finish_events("end_turn", "", 1);
    return 0;
  }
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
  } catch (const ApiError& e) {
    flashmoe::server::error_body(e);
  }
  return 0;
}
