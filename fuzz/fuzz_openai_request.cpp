// The server's request-body validation: the first byte picks chat or
// completions, the rest is the HTTP body.
#include "server/openai_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    flashmoe::server::parse_completion_request(body, data[0] & 1);
  } catch (const flashmoe::server::ApiError& e) {
    flashmoe::server::error_body(e);
  }
  return 0;
}
