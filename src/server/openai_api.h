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

// How the model may use the request's tools (OpenAI's tool_choice; Anthropic's
// tool_choice maps onto it: auto, any -> Required, tool -> Named, none).
enum class ToolChoice { Auto, None, Required, Named };

// One request in the server's own terms, whichever API it came in through.
struct CompletionRequest {
  bool chat = true;
  std::string model;                  // empty: not given
  // chat: the messages as the chat template gets them: {role, content
  // (string)}, assistant ones with optional reasoning_content and
  // tool_calls [{id, type, function: {name, arguments (an object)}}], tool
  // ones with tool_call_id.
  nlohmann::ordered_json messages;
  std::string prompt;                 // completions
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int> top_k;
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stop;
  std::optional<uint64_t> seed;
  float presence_penalty = 0, frequency_penalty = 0;
  std::vector<std::pair<int32_t, float>> logit_bias;  // token id -> bias in [-100, 100]
  int top_logprobs = -1;              // -1: no logprobs; else alternatives per token (0..20)
  bool stream = false, include_usage = false;
  bool ignore_eos = false;            // vLLM extension: generate to max_tokens
  nlohmann::ordered_json tools;       // null, or [{type: "function", function: {name, description, parameters}}]
  ToolChoice tool_choice = ToolChoice::Auto;
  std::string tool_name;              // ToolChoice::Named
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();  // extra chat template variables
  // vLLM extension: requests with different salts never share stored
  // conversation states (so cached_tokens cannot reveal another's prompt).
  std::string cache_salt;
  nlohmann::ordered_json response_format;  // null: not given; checked by make_json_constraint
};

// Parses and validates a /v1/chat/completions (chat=true) or /v1/completions
// body. Throws ApiError(400) naming the offending field, also for every field
// the server does not implement (an allow-list per endpoint; a field set to
// null counts as absent).
CompletionRequest parse_completion_request(const std::string& body, bool chat);

// Shared by the OpenAI and Anthropic parsers: `tools` in OpenAI's shape
// (validated: unique non-empty names, object parameters) and the tool choice
// checked against them. `where` names the field in messages.
void check_tools(const nlohmann::ordered_json& tools, const char* where);
void check_tool_choice(const CompletionRequest& r, const char* where);

}  // namespace flashmoe::server
