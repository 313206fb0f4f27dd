// OpenAI response objects for one answer: chat.completion /
// text_completion, and their stream chunks, built from the output parser's
// events (reasoning_content, content, tool_calls) and the tokens'
// log-probabilities. Kept free of HTTP like openai_api.h.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/logprobs.h"
#include "server/chat_output.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe::server {

class OpenAIResponseBuilder {
 public:
  // `logprobs`: the request asked for them (then every token passed to
  // add_logprob is reported).
  OpenAIResponseBuilder(bool chat, std::string id, std::string model, int64_t created, const Tokenizer& tok,
                        bool logprobs);

  // Chat streams open with {"role": "assistant", "content": ""}.
  nlohmann::ordered_json first_chunk() const;
  // A generated token's log-probability, reported with the next chunk.
  void add_logprob(const TokenLogprob& lp);
  // Records the events; returns the stream chunks they make (a tool call is
  // two: its id, type and name, then its arguments, as OpenAI streams them).
  std::vector<nlohmann::ordered_json> add(const std::vector<OutputEvent>& events);
  // The chunk with finish_reason (and the log-probabilities still pending).
  nlohmann::ordered_json finish_chunk(const std::string& finish_reason);
  // A usage-only chunk (stream_options.include_usage): empty choices.
  nlohmann::ordered_json usage_chunk(const nlohmann::ordered_json& usage) const;
  // The whole response (non-streamed).
  nlohmann::ordered_json response(const std::string& finish_reason, const nlohmann::ordered_json& usage) const;

  // "tool_calls" when the answer called a tool, else `base` ("stop", "length").
  std::string finish_reason(const std::string& base) const { return calls_.empty() ? base : "tool_calls"; }
  bool has_tool_calls() const { return !calls_.empty(); }

 private:
  nlohmann::ordered_json chunk(nlohmann::ordered_json delta_or_text, const nlohmann::ordered_json& finish);
  nlohmann::ordered_json take_pending_logprobs();
  nlohmann::ordered_json logprob_entry(int32_t id, float logprob) const;
  nlohmann::ordered_json logprobs_json(const std::vector<TokenLogprob>& lps, size_t text_offset) const;

  bool chat_;
  std::string id_, model_;
  int64_t created_;
  const Tokenizer& tok_;
  bool logprobs_;
  std::string content_, reasoning_;
  nlohmann::ordered_json calls_ = nlohmann::ordered_json::array();
  std::vector<TokenLogprob> all_, pending_;
  size_t pending_offset_ = 0;  // completions: text offset of the first pending token
};

}  // namespace flashmoe::server
