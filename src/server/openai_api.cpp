#include "server/openai_api.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>

#include "server/request_fields.h"

namespace flashmoe::server {

using json = nlohmann::ordered_json;

std::string error_body(const std::string& message, const std::string& type, const std::string& code,
                       const std::string& param) {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return json{{"error", e}}.dump();
}

std::string error_body(const ApiError& e) { return error_body(e.what(), e.type, e.code, e.param); }

namespace {

// Message content: a string, or an array of {"type": "text", "text": ...}
// parts (concatenated); null only for assistant messages.
std::string content_text(const json& m, size_t i, const std::string& role) {
  std::string where = "messages[" + std::to_string(i) + "].content";
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) {
    if (role == "assistant") return "";
    bad_field(where, "'" + where + "' is required");
  }
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::string s;
    for (const auto& part : *it) {
      // (A "type" that is not a string, such as 5, must be a 400 too, not
      // a JSON type error.)
      auto type = part.is_object() ? part.find("type") : part.end();
      if (!part.is_object() || type == part.end() || !type->is_string() || type->get<std::string>() != "text" ||
          !part.contains("text") || !part["text"].is_string())
        bad_field(where, "'" + where + "' parts must be {\"type\": \"text\", \"text\": \"...\"} (only text is supported)");
      s += part["text"].get<std::string>();
    }
    return s;
  }
  bad_field(where, "'" + where + "' must be a string or an array of text parts");
}


const json* string_field(const json& o, const char* name, const std::string& where) {
  const json* v = field(o, name);
  if (v && !v->is_string()) bad_field(where + name, "'" + where + name + "' must be a string");
  return v;
}

// An assistant message's tool_calls, with the arguments (a JSON string in the
// API) parsed into the object the chat templates iterate over.
json assistant_tool_calls(const json& calls, const std::string& where) {
  if (!calls.is_array()) bad_field(where, "'" + where + "' must be an array");
  json out = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string w = where + "[" + std::to_string(k) + "]";
    const json& c = calls[k];
    if (!c.is_object()) bad_field(w, "'" + w + "' must be an object");
    only_fields(c, {"id", "type", "function"}, w + ".");
    const json* type = string_field(c, "type", w + ".");
    if (type && *type != "function") bad_field(w + ".type", "'" + w + ".type' must be \"function\"");
    const json* id = string_field(c, "id", w + ".");
    const json* fn = field(c, "function");
    if (!fn || !fn->is_object()) bad_field(w + ".function", "'" + w + ".function' must be an object");
    only_fields(*fn, {"name", "arguments"}, w + ".function.");
    const json* name = string_field(*fn, "name", w + ".function.");
    if (!name || name->get<std::string>().empty()) bad_field(w + ".function.name", "'" + w + ".function.name' is required");
    json args = json::object();
    if (const json* a = field(*fn, "arguments")) {
      if (a->is_string()) args = json::parse(a->get<std::string>(), nullptr, false);
      else args = *a;
      if (!args.is_object())
        bad_field(w + ".function.arguments", "'" + w + ".function.arguments' must be a JSON object (as a string)");
    }
    out.push_back({{"id", id ? *id : json("")},
                   {"type", "function"},
                   {"function", {{"name", *name}, {"arguments", std::move(args)}}}});
  }
  return out;
}

json chat_message(const json& m, size_t i) {
  std::string where = "messages[" + std::to_string(i) + "]";
  if (!m.is_object()) bad_field(where, "'" + where + "' must be an object");
  auto role_it = m.find("role");
  if (role_it == m.end() || !role_it->is_string()) bad_field(where + ".role", "'" + where + ".role' must be a string");
  std::string role = role_it->get<std::string>();
  if (role == "developer") role = "system";
  json out = {{"role", role}};
  if (role == "system" || role == "user") {
    only_fields(m, {"role", "content"}, where + ".");
    out["content"] = content_text(m, i, role);
  } else if (role == "assistant") {
    only_fields(m, {"role", "content", "tool_calls", "reasoning_content"}, where + ".");
    out["content"] = content_text(m, i, role);
    if (const json* r = string_field(m, "reasoning_content", where + ".")) out["reasoning_content"] = *r;
    if (const json* c = field(m, "tool_calls")) out["tool_calls"] = assistant_tool_calls(*c, where + ".tool_calls");
  } else if (role == "tool") {
    only_fields(m, {"role", "content", "tool_call_id"}, where + ".");
    out["content"] = content_text(m, i, role);
    const json* id = string_field(m, "tool_call_id", where + ".");
    if (!id) bad_field(where + ".tool_call_id", "'" + where + ".tool_call_id' is required for a tool message");
    out["tool_call_id"] = *id;
  } else {
    bad_field(where + ".role", "'" + where + ".role' must be one of system, developer, user, assistant, tool");
  }
  return out;
}

void parse_tool_choice(const json& o, CompletionRequest& r) {
  const json* tc = field(o, "tool_choice");
  if (!tc) return;
  if (tc->is_string()) {
    const std::string v = tc->get<std::string>();
    if (v == "auto") r.tool_choice = ToolChoice::Auto;
    else if (v == "none") r.tool_choice = ToolChoice::None;
    else if (v == "required") r.tool_choice = ToolChoice::Required;
    else bad_field("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    return;
  }
  if (!tc->is_object() || tc->value("type", json()) != "function" || !tc->contains("function") ||
      !(*tc)["function"].is_object() || !(*tc)["function"].contains("name") || !(*tc)["function"]["name"].is_string())
    bad_field("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
  r.tool_choice = ToolChoice::Named;
  r.tool_name = (*tc)["function"]["name"].get<std::string>();
}

void parse_logit_bias(const json& o, CompletionRequest& r) {
  const json* lb = field(o, "logit_bias");
  if (!lb) return;
  if (!lb->is_object()) bad_field("logit_bias", "'logit_bias' must be an object mapping token ids to numbers");
  for (auto it = lb->begin(); it != lb->end(); ++it) {
    const std::string& k = it.key();
    char* end = nullptr;
    errno = 0;
    long long id = k.empty() ? -1 : std::strtoll(k.c_str(), &end, 10);
    if (k.empty() || *end != '\0' || errno != 0 || id < 0 || id > INT32_MAX)
      bad_field("logit_bias", "'logit_bias' keys must be token ids (non-negative integers), not '" + k + "'");
    if (!it.value().is_number() || !std::isfinite(it.value().get<double>()) || it.value().get<double>() < -100 ||
        it.value().get<double>() > 100)
      bad_field("logit_bias", "'logit_bias' values must be numbers between -100 and 100");
    r.logit_bias.emplace_back(int32_t(id), float(it.value().get<double>()));
  }
}

}  // namespace

void check_tools(const json& tools, const char* where) {
  const std::string w0 = where;
  if (!tools.is_array()) bad_field(w0, "'" + w0 + "' must be an array");
  std::vector<std::string> names;
  for (size_t k = 0; k < tools.size(); ++k) {
    const std::string w = w0 + "[" + std::to_string(k) + "]";
    const json& t = tools[k];
    if (!t.is_object() || t.value("type", json()) != "function")
      bad_field(w, "'" + w + "' must be {\"type\": \"function\", \"function\": {...}} (only function tools are supported)");
    only_fields(t, {"type", "function"}, w + ".");
    const json* fn = field(t, "function");
    if (!fn || !fn->is_object()) bad_field(w + ".function", "'" + w + ".function' must be an object");
    only_fields(*fn, {"name", "description", "parameters", "strict"}, w + ".function.");
    const json* name = string_field(*fn, "name", w + ".function.");
    if (!name || name->get<std::string>().empty()) bad_field(w + ".function.name", "'" + w + ".function.name' is required");
    const std::string n = name->get<std::string>();
    if (std::find(names.begin(), names.end(), n) != names.end())
      bad_field(w + ".function.name", "two tools are named '" + n + "'");
    names.push_back(n);
    string_field(*fn, "description", w + ".function.");
    if (const json* p = field(*fn, "parameters"); p && !p->is_object())
      bad_field(w + ".function.parameters", "'" + w + ".function.parameters' must be a JSON schema object");
    if (const json* s = field(*fn, "strict")) {
      if (!s->is_boolean()) bad_field(w + ".function.strict", "'" + w + ".function.strict' must be a boolean");
      if (s->get<bool>())
        bad_field(w + ".function.strict", "'" + w + ".function.strict': true is not supported (arguments are not constrained to the schema)");
    }
  }
}

void check_tool_choice(const CompletionRequest& r, const char* where) {
  const bool have = r.tools.is_array() && !r.tools.empty();
  if ((r.tool_choice == ToolChoice::Required || r.tool_choice == ToolChoice::Named) && !have)
    bad_field(where, std::string("'") + where + "' requires a tool but the request has no 'tools'");
  if (r.tool_choice == ToolChoice::Named) {
    for (const auto& t : r.tools)
      if (t["function"]["name"] == r.tool_name) return;
    bad_field(where, std::string("'") + where + "' names the tool '" + r.tool_name + "', which is not in 'tools'");
  }
}

CompletionRequest parse_completion_request(const std::string& body, bool chat) {
  const json o = parse_body_object(body);
  if (chat)
    only_fields(o, {"model", "messages", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
                    "max_completion_tokens", "n", "seed", "stop", "stream", "stream_options", "tools", "tool_choice",
                    "parallel_tool_calls", "chat_template_kwargs", "ignore_eos", "user", "cache_salt", "response_format"},
                "");
  else
    only_fields(o, {"model", "prompt", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "seed", "stop",
                    "stream", "stream_options", "ignore_eos", "user", "echo", "best_of", "cache_salt", "response_format"},
                "");
  CompletionRequest r;
  r.chat = chat;
  if (const json* m = field(o, "model")) {
    if (!m->is_string()) bad_field("model", "'model' must be a string");
    r.model = m->get<std::string>();
  }
  string_field(o, "user", "");
  if (chat) {
    const json* msgs = field(o, "messages");
    if (!msgs) bad_field("messages", "'messages' is required");
    if (!msgs->is_array()) bad_field("messages", "'messages' must be an array");
    if (msgs->empty()) bad_field("messages", "'messages' must not be empty");
    r.messages = json::array();
    for (size_t i = 0; i < msgs->size(); ++i) r.messages.push_back(chat_message((*msgs)[i], i));
    if (const json* t = field(o, "tools")) {
      check_tools(*t, "tools");
      if (!t->empty()) r.tools = *t;
    }
    parse_tool_choice(o, r);
    check_tool_choice(r, "tool_choice");
    if (const json* p = field(o, "parallel_tool_calls")) {
      if (!p->is_boolean()) bad_field("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
      if (!p->get<bool>())
        bad_field("parallel_tool_calls", "'parallel_tool_calls': false is not supported (the model may call several tools)");
    }
    if (const json* k = field(o, "chat_template_kwargs")) {
      if (!k->is_object()) bad_field("chat_template_kwargs", "'chat_template_kwargs' must be an object");
      for (auto it = k->begin(); it != k->end(); ++it)
        for (const char* reserved : {"messages", "tools", "add_generation_prompt", "documents", "bos_token",
                                     "eos_token"})
          if (it.key() == reserved)
            bad_field("chat_template_kwargs." + it.key(),
                "'chat_template_kwargs." + it.key() + "' is set by the server and cannot be overridden");
      r.template_kwargs = *k;
    }
    const bool lp = boolean_field(o, "logprobs");
    if (auto n = integer_field(o, "top_logprobs", 0, 20)) {
      if (!lp) bad_field("top_logprobs", "'top_logprobs' requires 'logprobs': true");
      r.top_logprobs = int(*n);
    } else if (lp) {
      r.top_logprobs = 0;
    }
  } else {
    const json* p = field(o, "prompt");
    if (!p) bad_field("prompt", "'prompt' is required");
    if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) p = &(*p)[0];
    if (!p->is_string()) bad_field("prompt", "'prompt' must be a string");
    r.prompt = p->get<std::string>();
    if (r.prompt.empty()) bad_field("prompt", "'prompt' must not be empty");
    if (auto n = integer_field(o, "logprobs", 0, 20)) r.top_logprobs = int(*n);
    if (boolean_field(o, "echo")) bad_field("echo", "'echo': true is not supported");
    if (auto b = integer_field(o, "best_of", 1, INT64_MAX); b && *b != 1) bad_field("best_of", "only best_of = 1 is supported");
  }
  if (auto t = number_field(o, "temperature", 0, 2)) r.temperature = float(*t);
  if (auto t = number_field(o, "top_p", 0, 1)) r.top_p = float(*t);
  if (auto t = number_field(o, "min_p", 0, 1)) r.min_p = float(*t);
  if (auto t = number_field(o, "repetition_penalty", 0.01, 10)) r.repetition_penalty = float(*t);
  if (auto k = integer_field(o, "top_k", -1, INT32_MAX)) r.top_k = int(*k);  // -1, 0: off
  if (auto t = number_field(o, "presence_penalty", -2, 2)) r.presence_penalty = float(*t);
  if (auto t = number_field(o, "frequency_penalty", -2, 2)) r.frequency_penalty = float(*t);
  parse_logit_bias(o, r);
  // The server's own cap (--max-tokens) is checked where it is known.
  auto mt = integer_field(o, "max_completion_tokens", 1, INT64_MAX);
  if (!mt) mt = integer_field(o, "max_tokens", 1, INT64_MAX);
  if (mt) r.max_tokens = *mt;
  if (auto n = integer_field(o, "n", 1, INT64_MAX); n && *n != 1) bad_field("n", "only n = 1 is supported");
  if (const json* s = field(o, "seed"); s && s->is_number_unsigned()) r.seed = s->get<uint64_t>();
  else if (auto s = integer_field(o, "seed", INT64_MIN, INT64_MAX)) r.seed = uint64_t(*s);
  if (const json* s = field(o, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > 4) bad_field("stop", "'stop' takes at most 4 strings");
      for (const auto& x : *s) {
        if (!x.is_string()) bad_field("stop", "'stop' must be a string or an array of strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      bad_field("stop", "'stop' must be a string or an array of strings");
    }
  }
  r.stream = boolean_field(o, "stream");
  if (const json* so = field(o, "stream_options")) {
    if (!so->is_object()) bad_field("stream_options", "'stream_options' must be an object");
    only_fields(*so, {"include_usage"}, "stream_options.");
    r.include_usage = boolean_field(*so, "include_usage");
  }
  r.ignore_eos = boolean_field(o, "ignore_eos");
  if (const json* salt = field(o, "cache_salt")) {
    if (!salt->is_string()) bad_field("cache_salt", "'cache_salt' must be a string");
    r.cache_salt = salt->get<std::string>();
  }
  if (const json* rf = field(o, "response_format")) r.response_format = *rf;  // the server compiles it
  return r;
}

}  // namespace flashmoe::server
