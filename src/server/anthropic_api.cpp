#include "server/anthropic_api.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>

#include "server/ids.h"
#include "server/request_fields.h"

namespace flashmoe::server {

using json = nlohmann::ordered_json;

namespace {

std::string need_string(const json& o, const char* name, const std::string& where) {
  const json* v = field(o, name);
  if (!v || !v->is_string()) bad_field(where + name, "'" + where + name + "' must be a string");
  return v->get<std::string>();
}


// A text block: {"type": "text", "text": ...}; cache_control is a caching
// hint (this server's state cache works on its own) and citations are not
// produced for input.
std::string text_block(const json& b, const std::string& where) {
  only_fields(b, {"type", "text", "cache_control"}, where + ".");
  return need_string(b, "text", where + ".");
}

// String content, or the text of an array of text blocks.
std::string text_content(const json& c, const std::string& where) {
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) bad_field(where, "'" + where + "' must be a string or an array of text blocks");
  std::string s;
  for (size_t k = 0; k < c.size(); ++k) {
    const std::string w = where + "[" + std::to_string(k) + "]";
    if (!c[k].is_object() || c[k].value("type", json()) != "text")
      bad_field(w, "'" + w + "' must be a text block (only text is supported here)");
    s += text_block(c[k], w);
  }
  return s;
}

// A message's content (required): a string, or an array of blocks.
const json& message_content(const json& m, const std::string& where) {
  const json* c = field(m, "content");
  if (!c) bad_field(where + ".content", "'" + where + ".content' is required");
  if (!c->is_string() && !c->is_array())
    bad_field(where + ".content", "'" + where + ".content' must be a string or an array of blocks");
  return *c;
}

// Calls f(block, its place in the request, its type ("" if it has none))
// for each block of an array content.
template <class F>
void for_each_block(const json& content, const std::string& where, F&& f) {
  for (size_t k = 0; k < content.size(); ++k) {
    const std::string w = where + ".content[" + std::to_string(k) + "]";
    const json& b = content[k];
    const json* type = b.is_object() ? field(b, "type") : nullptr;
    f(b, w, type && type->is_string() ? type->get<std::string>() : std::string());
  }
}

void add_user(const json& m, const std::string& where, json& out) {
  const json& c = message_content(m, where);
  if (c.is_string()) {
    out.push_back({{"role", "user"}, {"content", c}});
    return;
  }
  if (c.empty()) bad_field(where + ".content", "'" + where + ".content' must be a string or a non-empty array of blocks");
  std::string text;
  for_each_block(c, where, [&](const json& b, const std::string& w, const std::string& type) {
    if (type == "text") {
      text += text_block(b, w);
    } else if (type == "tool_result") {
      only_fields(b, {"type", "tool_use_id", "content", "is_error", "cache_control"}, w + ".");
      std::string id = need_string(b, "tool_use_id", w + ".");
      std::string result;
      if (const json* rc = field(b, "content")) result = text_content(*rc, w + ".content");
      if (const json* e = field(b, "is_error")) {
        if (!e->is_boolean()) bad_field(w + ".is_error", "'" + w + ".is_error' must be a boolean");
        if (e->get<bool>()) result = "Error: " + result;  // the template has no error flag; say it in the text
      }
      // Text before a tool result would be reordered: keep the turn's order.
      if (!text.empty()) {
        out.push_back({{"role", "user"}, {"content", text}});
        text.clear();
      }
      out.push_back({{"role", "tool"}, {"content", result}, {"tool_call_id", id}});
    } else {
      bad_field(w + ".type", "'" + w + ".type' must be \"text\" or \"tool_result\" in a user message (got '" + type + "')");
    }
  });
  if (!text.empty()) out.push_back({{"role", "user"}, {"content", text}});
}

void add_assistant(const json& m, const std::string& where, json& out) {
  const json& c = message_content(m, where);
  json msg = {{"role", "assistant"}, {"content", ""}};
  if (c.is_string()) {
    msg["content"] = c;
    out.push_back(std::move(msg));
    return;
  }
  std::string text, reasoning;
  json calls = json::array();
  for_each_block(c, where, [&](const json& b, const std::string& w, const std::string& type) {
    if (type == "text") {
      text += text_block(b, w);
    } else if (type == "tool_use") {
      only_fields(b, {"type", "id", "name", "input", "cache_control"}, w + ".");
      std::string id = need_string(b, "id", w + ".");
      std::string name = need_string(b, "name", w + ".");
      const json* input = field(b, "input");
      if (!input || !input->is_object()) bad_field(w + ".input", "'" + w + ".input' must be an object");
      calls.push_back({{"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", *input}}}});
    } else if (type == "thinking") {
      only_fields(b, {"type", "thinking", "signature"}, w + ".");
      reasoning += need_string(b, "thinking", w + ".");
    } else {
      bad_field(w + ".type", "'" + w + ".type' must be \"text\", \"tool_use\" or \"thinking\" in an assistant message (got '" +
                           type + "')");
    }
  });
  msg["content"] = text;
  if (!reasoning.empty()) msg["reasoning_content"] = reasoning;
  if (!calls.empty()) msg["tool_calls"] = std::move(calls);
  out.push_back(std::move(msg));
}

json convert_tools(const json& tools) {
  if (!tools.is_array()) bad_field("tools", "'tools' must be an array");
  json out = json::array();
  for (size_t k = 0; k < tools.size(); ++k) {
    const std::string w = "tools[" + std::to_string(k) + "]";
    const json& t = tools[k];
    if (!t.is_object()) bad_field(w, "'" + w + "' must be an object");
    if (const json* type = field(t, "type"); type && *type != "custom")
      bad_field(w + ".type", "'" + w + ".type' must be \"custom\" (server tools are not supported)");
    only_fields(t, {"type", "name", "description", "input_schema", "cache_control"}, w + ".");
    json fn = {{"name", need_string(t, "name", w + ".")}};
    if (field(t, "description")) fn["description"] = need_string(t, "description", w + ".");
    const json* schema = field(t, "input_schema");
    if (!schema || !schema->is_object()) bad_field(w + ".input_schema", "'" + w + ".input_schema' must be a JSON schema object");
    fn["parameters"] = *schema;
    out.push_back({{"type", "function"}, {"function", std::move(fn)}});
  }
  check_tools(out, "tools");
  return out;
}

}  // namespace

CompletionRequest parse_anthropic_request(const std::string& body, bool count_tokens) {
  const json o = parse_body_object(body);
  if (count_tokens)
    only_fields(o, {"model", "messages", "system", "tools", "tool_choice"}, "");
  else
    only_fields(o, {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p",
                    "top_k", "tools", "tool_choice", "metadata"},
                "");
  CompletionRequest r;
  r.chat = true;
  r.model = need_string(o, "model", "");
  if (!count_tokens) {
    const json* mt = field(o, "max_tokens");
    if (!mt) bad_field("max_tokens", "'max_tokens' is required");
    if (!mt->is_number_integer() || (mt->is_number_unsigned() ? false : mt->get<int64_t>() < 1))
      bad_field("max_tokens", "'max_tokens' must be a positive integer");
    r.max_tokens = mt->is_number_unsigned() ? int64_t(std::min<uint64_t>(mt->get<uint64_t>(), uint64_t(INT64_MAX)))
                                            : mt->get<int64_t>();
  }
  r.messages = json::array();
  if (const json* sys = field(o, "system")) r.messages.push_back({{"role", "system"}, {"content", text_content(*sys, "system")}});
  const json* msgs = field(o, "messages");
  if (!msgs || !msgs->is_array() || msgs->empty()) bad_field("messages", "'messages' must be a non-empty array");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    const json& m = (*msgs)[i];
    if (!m.is_object()) bad_field(where, "'" + where + "' must be an object");
    only_fields(m, {"role", "content"}, where + ".");
    const std::string role = need_string(m, "role", where + ".");
    if (role == "user") add_user(m, where, r.messages);
    else if (role == "assistant") add_assistant(m, where, r.messages);
    else bad_field(where + ".role", "'" + where + ".role' must be \"user\" or \"assistant\"");
  }
  if (const json* s = field(o, "stop_sequences")) {
    if (!s->is_array()) bad_field("stop_sequences", "'stop_sequences' must be an array of strings");
    for (const auto& x : *s) {
      if (!x.is_string() || x.get<std::string>().empty())
        bad_field("stop_sequences", "'stop_sequences' must be an array of non-empty strings");
      r.stop.push_back(x.get<std::string>());
    }
  }
  if (const json* s = field(o, "stream")) {
    if (!s->is_boolean()) bad_field("stream", "'stream' must be a boolean");
    r.stream = s->get<bool>();
  }
  if (auto t = number_field(o, "temperature", 0, 1)) r.temperature = float(*t);
  if (auto t = number_field(o, "top_p", 0, 1)) r.top_p = float(*t);
  if (const json* k = field(o, "top_k")) {
    if (!k->is_number_integer() || k->get<int64_t>() < 0 || k->get<int64_t>() > INT32_MAX)
      bad_field("top_k", "'top_k' must be a non-negative integer");
    r.top_k = int(k->get<int64_t>());
  }
  if (const json* md = field(o, "metadata")) {
    // user_id is an opaque tag for abuse tracking; it does not change the answer.
    if (!md->is_object()) bad_field("metadata", "'metadata' must be an object");
    only_fields(*md, {"user_id"}, "metadata.");
  }
  if (const json* t = field(o, "tools")) {
    json tools = convert_tools(*t);
    if (!tools.empty()) r.tools = std::move(tools);
  }
  if (const json* tc = field(o, "tool_choice")) {
    if (!tc->is_object()) bad_field("tool_choice", "'tool_choice' must be an object");
    only_fields(*tc, {"type", "name", "disable_parallel_tool_use"}, "tool_choice.");
    const std::string type = need_string(*tc, "type", "tool_choice.");
    if (const json* d = field(*tc, "disable_parallel_tool_use"); d && (!d->is_boolean() || d->get<bool>()))
      bad_field("tool_choice.disable_parallel_tool_use", "'tool_choice.disable_parallel_tool_use': true is not supported");
    if (type == "auto") r.tool_choice = ToolChoice::Auto;
    else if (type == "any") r.tool_choice = ToolChoice::Required;
    else if (type == "none") r.tool_choice = ToolChoice::None;
    else if (type == "tool") {
      r.tool_choice = ToolChoice::Named;
      r.tool_name = need_string(*tc, "name", "tool_choice.");
    } else {
      bad_field("tool_choice.type", "'tool_choice.type' must be \"auto\", \"any\", \"tool\" or \"none\"");
    }
    check_tool_choice(r, "tool_choice");
  }
  return r;
}

std::string anthropic_error_body(int status, const std::string& message) {
  const char* type = status == 400   ? "invalid_request_error"
                     : status == 401 ? "authentication_error"
                     : status == 403 ? "permission_error"
                     : status == 404 ? "not_found_error"
                     : status == 413 ? "request_too_large"
                     : status == 429 ? "rate_limit_error"
                     : status == 503 ? "overloaded_error"
                     : status < 500  ? "invalid_request_error"
                                     : "api_error";
  return json{{"type", "error"}, {"error", {{"type", type}, {"message", message}}}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

std::string anthropic_stop_reason(const std::string& finish_reason, const std::string& stop_string, bool tool_calls) {
  if (tool_calls) return "tool_use";  // a complete call, even when the token limit came right after it
  if (finish_reason == "length") return "max_tokens";
  if (!stop_string.empty()) return "stop_sequence";
  return "end_turn";
}

namespace {
std::string event(const char* name, const json& data) {
  return std::string("event: ") + name + "\ndata: " + data.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}
}  // namespace

AnthropicMessageBuilder::AnthropicMessageBuilder(std::string id, std::string model, int64_t input_tokens)
    : id_(std::move(id)), model_(std::move(model)), input_tokens_(input_tokens) {}

std::string AnthropicMessageBuilder::start_event() const {
  json msg = {{"id", id_},
              {"type", "message"},
              {"role", "assistant"},
              {"model", model_},
              {"content", json::array()},
              {"stop_reason", nullptr},
              {"stop_sequence", nullptr},
              {"usage", {{"input_tokens", input_tokens_}, {"output_tokens", 0}}}};
  return event("message_start", {{"type", "message_start"}, {"message", msg}});
}

std::string AnthropicMessageBuilder::close_block() {
  if (!open_) return "";
  open_ = false;
  return event("content_block_stop", {{"type", "content_block_stop"}, {"index", blocks_.size() - 1}});
}

std::string AnthropicMessageBuilder::add(const std::vector<OutputEvent>& events) {
  std::string out;
  for (const OutputEvent& e : events) {
    const char* type = e.kind == OutputEvent::Kind::Reasoning ? "thinking"
                       : e.kind == OutputEvent::Kind::Content ? "text"
                                                              : "tool_use";
    const bool extend = open_ && e.kind != OutputEvent::Kind::ToolCall && blocks_.back()["type"] == type;
    if (!extend) {
      out += close_block();
      json block;
      if (e.kind == OutputEvent::Kind::Reasoning) block = {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}};
      else if (e.kind == OutputEvent::Kind::Content) block = {{"type", "text"}, {"text", ""}};
      else block = {{"type", "tool_use"}, {"id", random_id("toolu_")}, {"name", e.call.name}, {"input", json::object()}};
      blocks_.push_back(block);
      open_ = true;
      out += event("content_block_start", {{"type", "content_block_start"}, {"index", blocks_.size() - 1}, {"content_block", block}});
    }
    json& b = blocks_.back();
    json delta;
    if (e.kind == OutputEvent::Kind::Reasoning) {
      b["thinking"] = b["thinking"].get<std::string>() + e.text;
      delta = {{"type", "thinking_delta"}, {"thinking", e.text}};
    } else if (e.kind == OutputEvent::Kind::Content) {
      b["text"] = b["text"].get<std::string>() + e.text;
      delta = {{"type", "text_delta"}, {"text", e.text}};
    } else {
      ++tool_calls_;
      b["input"] = json::parse(e.call.arguments);
      delta = {{"type", "input_json_delta"}, {"partial_json", e.call.arguments}};
    }
    out += event("content_block_delta", {{"type", "content_block_delta"}, {"index", blocks_.size() - 1}, {"delta", delta}});
    if (e.kind == OutputEvent::Kind::ToolCall) out += close_block();
  }
  return out;
}

std::string AnthropicMessageBuilder::finish_events(const std::string& stop_reason, const std::string& stop_string,
                                                   int64_t output_tokens) {
  std::string out = close_block();
  out += event("message_delta",
               {{"type", "message_delta"},
                {"delta", {{"stop_reason", stop_reason}, {"stop_sequence", stop_string.empty() ? json() : json(stop_string)}}},
                {"usage", {{"output_tokens", output_tokens}}}});
  out += event("message_stop", {{"type", "message_stop"}});
  return out;
}

json AnthropicMessageBuilder::message(const std::string& stop_reason, const std::string& stop_string,
                                      int64_t output_tokens) const {
  return {{"id", id_},
          {"type", "message"},
          {"role", "assistant"},
          {"model", model_},
          {"content", blocks_},
          {"stop_reason", stop_reason},
          {"stop_sequence", stop_string.empty() ? json() : json(stop_string)},
          {"usage", {{"input_tokens", input_tokens_}, {"output_tokens", output_tokens}}}};
}

}  // namespace flashmoe::server
