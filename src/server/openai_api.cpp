#include "server/openai_api.h"

#include <cmath>

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

[[noreturn]] void bad(const std::string& param, const std::string& msg) {
  throw ApiError(400, msg, "invalid_request_error", "", param);
}

// A present, non-null field.
const json* field(const json& o, const char* name) {
  auto it = o.find(name);
  if (it == o.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> number(const json& o, const char* name, double lo, double hi) {
  const json* v = field(o, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(name, std::string("'") + name + "' must be a number");
  double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    bad(name, std::string("'") + name + "' must be between " + json(lo).dump() + " and " + json(hi).dump());
  return x;
}

std::optional<int64_t> integer(const json& o, const char* name) {
  const json* v = field(o, name);
  if (!v) return std::nullopt;
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_number_float()) {
    double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e18) return int64_t(d);
  }
  bad(name, std::string("'") + name + "' must be an integer");
}

bool boolean(const json& o, const char* name) {
  const json* v = field(o, name);
  if (!v) return false;
  if (!v->is_boolean()) bad(name, std::string("'") + name + "' must be a boolean");
  return v->get<bool>();
}

// Message content: a string, or an array of {"type": "text", "text": ...}
// parts (concatenated); null only for assistant messages.
std::string content_text(const json& m, size_t i, const std::string& role) {
  std::string where = "messages[" + std::to_string(i) + "].content";
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) {
    if (role == "assistant") return "";
    bad(where, "'" + where + "' is required");
  }
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::string s;
    for (const auto& part : *it) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
        bad(where, "'" + where + "' parts must be {\"type\": \"text\", \"text\": \"...\"} (only text is supported)");
      s += part["text"].get<std::string>();
    }
    return s;
  }
  bad(where, "'" + where + "' must be a string or an array of text parts");
}

}  // namespace

CompletionRequest parse_completion_request(const std::string& body, bool chat) {
  json o;
  try {
    o = json::parse(body);
  } catch (const json::exception&) {
    bad("", "the request body is not valid JSON");
  }
  if (!o.is_object()) bad("", "the request body must be a JSON object");
  CompletionRequest r;
  r.chat = chat;
  if (const json* m = field(o, "model")) {
    if (!m->is_string()) bad("model", "'model' must be a string");
    r.model = m->get<std::string>();
  }
  if (chat) {
    const json* msgs = field(o, "messages");
    if (!msgs) bad("messages", "'messages' is required");
    if (!msgs->is_array()) bad("messages", "'messages' must be an array");
    if (msgs->empty()) bad("messages", "'messages' must not be empty");
    r.messages = json::array();
    for (size_t i = 0; i < msgs->size(); ++i) {
      const json& m = (*msgs)[i];
      std::string where = "messages[" + std::to_string(i) + "]";
      if (!m.is_object()) bad(where, "'" + where + "' must be an object");
      auto role_it = m.find("role");
      if (role_it == m.end() || !role_it->is_string()) bad(where + ".role", "'" + where + ".role' must be a string");
      std::string role = role_it->get<std::string>();
      if (role == "developer") role = "system";
      if (role != "system" && role != "user" && role != "assistant")
        bad(where + ".role", "'" + where + ".role' must be one of system, developer, user, assistant");
      r.messages.push_back({{"role", role}, {"content", content_text(m, i, role)}});
    }
  } else {
    const json* p = field(o, "prompt");
    if (!p) bad("prompt", "'prompt' is required");
    if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) p = &(*p)[0];
    if (!p->is_string()) bad("prompt", "'prompt' must be a string");
    r.prompt = p->get<std::string>();
    if (r.prompt.empty()) bad("prompt", "'prompt' must not be empty");
  }
  if (auto t = number(o, "temperature", 0, 2)) r.temperature = float(*t);
  if (auto t = number(o, "top_p", 0, 1)) r.top_p = float(*t);
  if (auto t = number(o, "presence_penalty", -2, 2)) r.presence_penalty = float(*t);
  if (auto t = number(o, "frequency_penalty", -2, 2)) r.frequency_penalty = float(*t);
  auto mt = integer(o, "max_completion_tokens");
  if (!mt) mt = integer(o, "max_tokens");
  if (mt) {
    if (*mt < 1) bad("max_tokens", "'max_tokens' must be at least 1");
    r.max_tokens = *mt;
  }
  if (auto n = integer(o, "n"); n && *n != 1) bad("n", "only n = 1 is supported");
  if (auto s = integer(o, "seed")) r.seed = uint64_t(*s);
  if (const json* s = field(o, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > 4) bad("stop", "'stop' takes at most 4 strings");
      for (const auto& x : *s) {
        if (!x.is_string()) bad("stop", "'stop' must be a string or an array of strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or an array of strings");
    }
  }
  r.stream = boolean(o, "stream");
  if (const json* so = field(o, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "'stream_options' must be an object");
    r.include_usage = boolean(*so, "include_usage");
  }
  r.ignore_eos = boolean(o, "ignore_eos");
  if (const json* rf = field(o, "response_format")) r.response_format = *rf;  // the server compiles it
  return r;
}

}  // namespace flashmoe::server
