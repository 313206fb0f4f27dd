#include "server/openai_response.h"

#include "server/ids.h"

namespace flashmoe::server {

using json = nlohmann::ordered_json;

OpenAIResponseBuilder::OpenAIResponseBuilder(bool chat, std::string id, std::string model, int64_t created,
                                             const Tokenizer& tok, bool logprobs)
    : chat_(chat), id_(std::move(id)), model_(std::move(model)), created_(created), tok_(tok), logprobs_(logprobs) {}

json OpenAIResponseBuilder::first_chunk() const {
  json c = {{"index", 0}};
  if (chat_) c["delta"] = {{"role", "assistant"}, {"content", ""}};
  else c["text"] = "";
  c["logprobs"] = nullptr;
  c["finish_reason"] = nullptr;
  return {{"id", id_},
          {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", json::array({c})}};
}

void OpenAIResponseBuilder::add_logprob(const TokenLogprob& lp) {
  if (!logprobs_) return;
  all_.push_back(lp);
  pending_.push_back(lp);
}

// The token as OpenAI shows it: its text (bytes that are not whole UTF-8
// characters come out as U+FFFD when serialised) and the raw bytes.
json OpenAIResponseBuilder::logprob_entry(int32_t id, float logprob) const {
  const std::string& piece = tok_.token_to_piece(id);
  json bytes = json::array();
  for (unsigned char c : piece) bytes.push_back(int(c));
  return {{"token", piece}, {"logprob", logprob}, {"bytes", bytes}};
}

json OpenAIResponseBuilder::logprobs_json(const std::vector<TokenLogprob>& lps, size_t text_offset) const {
  if (chat_) {
    json content = json::array();
    for (const auto& lp : lps) {
      json e = logprob_entry(lp.id, lp.logprob);
      json top = json::array();
      for (const auto& [id, l] : lp.top) top.push_back(logprob_entry(id, l));
      e["top_logprobs"] = std::move(top);
      content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  // Completions' older shape: parallel arrays.
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  size_t off = text_offset;
  for (const auto& lp : lps) {
    const std::string& piece = tok_.token_to_piece(lp.id);
    tokens.push_back(piece);
    token_logprobs.push_back(lp.logprob);
    json t = json::object();
    for (const auto& [id, l] : lp.top) t[tok_.token_to_piece(id)] = l;
    top.push_back(std::move(t));
    offsets.push_back(off);
    off += piece.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json OpenAIResponseBuilder::take_pending_logprobs() {
  if (!logprobs_) return nullptr;
  json j = logprobs_json(pending_, pending_offset_);
  for (const auto& lp : pending_) pending_offset_ += tok_.token_to_piece(lp.id).size();
  pending_.clear();
  return j;
}

json OpenAIResponseBuilder::chunk(json delta_or_text, const json& finish) {
  json c = {{"index", 0}};
  if (chat_) c["delta"] = std::move(delta_or_text);
  else c["text"] = std::move(delta_or_text);
  c["logprobs"] = take_pending_logprobs();
  c["finish_reason"] = finish;
  return {{"id", id_},
          {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", json::array({c})}};
}

std::vector<json> OpenAIResponseBuilder::add(const std::vector<OutputEvent>& events) {
  std::vector<json> out;
  for (const OutputEvent& e : events) {
    if (e.kind == OutputEvent::Kind::Content) {
      content_ += e.text;
      out.push_back(chunk(chat_ ? json{{"content", e.text}} : json(e.text), nullptr));
    } else if (e.kind == OutputEvent::Kind::Reasoning) {
      reasoning_ += e.text;
      out.push_back(chunk(json{{"reasoning_content", e.text}}, nullptr));
    } else {
      const int index = int(calls_.size());
      const std::string id = random_id("call_");
      calls_.push_back({{"id", id}, {"type", "function"}, {"function", {{"name", e.call.name}, {"arguments", e.call.arguments}}}});
      out.push_back(chunk(json{{"tool_calls", json::array({{{"index", index},
                                                            {"id", id},
                                                            {"type", "function"},
                                                            {"function", {{"name", e.call.name}, {"arguments", ""}}}}})}},
                          nullptr));
      out.push_back(chunk(json{{"tool_calls", json::array({{{"index", index}, {"function", {{"arguments", e.call.arguments}}}}})}},
                          nullptr));
    }
  }
  return out;
}

json OpenAIResponseBuilder::finish_chunk(const std::string& finish_reason) {
  return chunk(chat_ ? json::object() : json(""), finish_reason);
}

json OpenAIResponseBuilder::usage_chunk(const json& usage) const {
  return {{"id", id_},
          {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", json::array()},
          {"usage", usage}};
}

json OpenAIResponseBuilder::response(const std::string& finish_reason, const json& usage) const {
  json choice = {{"index", 0}};
  if (chat_) {
    json msg = {{"role", "assistant"}, {"content", content_.empty() && !calls_.empty() ? json() : json(content_)}};
    if (!reasoning_.empty()) msg["reasoning_content"] = reasoning_;
    if (!calls_.empty()) msg["tool_calls"] = calls_;
    choice["message"] = std::move(msg);
  } else {
    choice["text"] = content_;
  }
  choice["logprobs"] = logprobs_ ? logprobs_json(all_, 0) : json();
  choice["finish_reason"] = finish_reason;
  return {{"id", id_},
          {"object", chat_ ? "chat.completion" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", json::array({choice})},
          {"usage", usage}};
}

}  // namespace flashmoe::server
