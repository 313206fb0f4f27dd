// The Anthropic Messages API (POST /v1/messages) in the server's own terms:
// a request becomes a CompletionRequest (system prompt, text / tool_use /
// tool_result / thinking blocks turned into the chat template's messages,
// tools into OpenAI-shaped function tools); a result becomes a Message
// object, or the event stream Anthropic sends (message_start,
// content_block_start/delta/stop, message_delta, message_stop). Kept free of
// HTTP, like openai_api.h.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/chat_output.h"
#include "server/openai_api.h"

namespace flashmoe::server {

// Validates and converts a /v1/messages body; ApiError(400) names the field.
// Fields outside the allow-list are a 400 too. `count_tokens`: a
// /v1/messages/count_tokens body (no max_tokens, stop_sequences, sampling
// or stream).
CompletionRequest parse_anthropic_request(const std::string& body, bool count_tokens = false);

// {"type": "error", "error": {"type", "message"}}, the error type derived
// from the HTTP status as Anthropic does (400 invalid_request_error, 401
// authentication_error, 404 not_found_error, 413 request_too_large, 429
// rate_limit_error, 503 overloaded_error, else api_error).
std::string anthropic_error_body(int status, const std::string& message);

// "tool_use" when the answer holds a complete tool call, else "max_tokens",
// "stop_sequence" or "end_turn".
std::string anthropic_stop_reason(const std::string& finish_reason, const std::string& stop_string, bool tool_calls);

// Builds the content blocks of one answer from the parser's events, both as
// a whole Message and as stream events (the same blocks either way).
class AnthropicMessageBuilder {
 public:
  AnthropicMessageBuilder(std::string id, std::string model, int64_t input_tokens);

  // The stream's first event.
  std::string start_event() const;
  // Takes the parser's events; returns the stream events they make (each
  // tool call gets a fresh "toolu_" id).
  std::string add(const std::vector<OutputEvent>& events);
  // Closes the last block; message_delta (stop_reason, usage) and message_stop.
  std::string finish_events(const std::string& stop_reason, const std::string& stop_string, int64_t output_tokens);
  // The whole Message (non-streamed).
  nlohmann::ordered_json message(const std::string& stop_reason, const std::string& stop_string,
                                 int64_t output_tokens) const;
  bool has_tool_calls() const { return tool_calls_ > 0; }

 private:
  std::string close_block();
  std::string id_, model_;
  int64_t input_tokens_;
  nlohmann::ordered_json blocks_ = nlohmann::ordered_json::array();
  bool open_ = false;  // the last block is still open (stream)
  int tool_calls_ = 0;
};

}  // namespace flashmoe::server
