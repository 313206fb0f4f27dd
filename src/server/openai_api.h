// The OpenAI-compatible request/response shapes, kept free of HTTP so they can
// be tested alone. Every validation failure is an ApiError carrying the HTTP
// status and a message that is safe to show a client (no paths, no internal
// exception text).
#pragma once
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace flashmoe::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string type = "invalid_request_error",
           std::string code = "", std::string param = "")
      : std::runtime_error(message), status(status), type(std::move(type)), code(std::move(code)),
        param(std::move(param)) {}
  int status;
  std::string type, code, param;
};

// {"error": {"message", "type", "code", "param"}} (code/param null when empty).
std::string error_body(const std::string& message, const std::string& type, const std::string& code = "",
                       const std::string& param = "");
std::string error_body(const ApiError& e);

struct CompletionRequest {
  bool chat = true;
  std::string model;                  // empty: not given
  nlohmann::ordered_json messages;    // chat: [{role, content}] with string contents
  std::string prompt;                 // completions
  std::optional<float> temperature, top_p;
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stop;
  std::optional<uint64_t> seed;
  float presence_penalty = 0, frequency_penalty = 0;
  bool stream = false, include_usage = false;
  bool ignore_eos = false;            // vLLM extension: generate to max_tokens
  nlohmann::ordered_json response_format;  // null: not given; checked by make_json_constraint
};

// Parses and validates a /v1/chat/completions (chat=true) or /v1/completions
// body. Throws ApiError(400) naming the offending field.
CompletionRequest parse_completion_request(const std::string& body, bool chat);

}  // namespace flashmoe::server
