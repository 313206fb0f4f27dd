#include "server/chat_output.h"

#include <algorithm>

namespace flashmoe::server {

using json = nlohmann::ordered_json;

namespace {

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>", kCallClose = "</tool_call>";

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

bool all_space(std::string_view s) { return std::all_of(s.begin(), s.end(), is_space); }

// Length of the longest suffix of `s` that is a proper prefix of `tag`: text
// that may still turn into the tag and must wait for the next piece.
size_t partial_tag_suffix(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

// The JSON schema type of parameter `param` of tool `fn`, "" when unknown.
std::string schema_type(const json& tools, const std::string& fn, const std::string& param) {
  if (!tools.is_array()) return "";
  for (const auto& t : tools) {
    if (!t.is_object()) continue;
    const json& f = t.contains("function") ? t["function"] : t;
    if (!f.is_object() || f.value("name", "") != fn) continue;
    auto p = f.find("parameters");
    if (p == f.end() || !p->is_object()) return "";
    auto props = p->find("properties");
    if (props == p->end() || !props->is_object() || !props->contains(param)) return "";
    const json& ty = (*props)[param].is_object() ? (*props)[param].value("type", json()) : json();
    if (ty.is_string()) return ty.get<std::string>();
    if (ty.is_array())  // ["integer", "null"]: typed unless it may be a string
      for (const auto& x : ty)
        if (x == "string") return "string";
    return ty.is_array() && !ty.empty() ? "json" : "";
  }
  return "";
}

// The end (one past the closing brace) of the JSON object `s` starts with
// (after whitespace), or npos while it is incomplete or `s` is not one.
size_t json_object_end(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && is_space(s[i])) ++i;
  if (i == s.size() || s[i] != '{') return std::string_view::npos;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

bool parse_json_call(std::string_view body, ToolCall* out) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) return false;
  json args = json::object();
  auto a = j.find("arguments");
  if (a == j.end()) a = j.find("parameters");
  if (a != j.end() && !a->is_null()) {
    args = *a;
    if (args.is_string()) args = json::parse(a->get<std::string>(), nullptr, false);
    if (!args.is_object()) return false;
  }
  out->name = name->get<std::string>();
  out->arguments = args.dump(-1, ' ', false, json::error_handler_t::replace);
  return true;
}

bool parse_xml_call(std::string_view body, const json& tools, ToolCall* out) {
  constexpr std::string_view fopen = "<function=", fclose = "</function>";
  constexpr std::string_view popen = "<parameter=", pclose = "</parameter>";
  if (body.substr(0, fopen.size()) != fopen) return false;
  size_t gt = body.find('>');
  if (gt == std::string_view::npos) return false;
  std::string name(trim(body.substr(fopen.size(), gt - fopen.size())));
  if (name.empty() || name.find('\n') != std::string::npos) return false;
  std::string_view rest = body.substr(gt + 1);
  size_t end = rest.rfind(fclose);
  if (end != std::string_view::npos) {
    if (!all_space(rest.substr(end + fclose.size()))) return false;
    rest = rest.substr(0, end);
  }
  json args = json::object();
  while (true) {
    size_t p = rest.find(popen);
    if (p == std::string_view::npos) {
      if (!all_space(rest)) return false;
      break;
    }
    if (!all_space(rest.substr(0, p))) return false;
    rest = rest.substr(p + popen.size());
    size_t pgt = rest.find('>');
    if (pgt == std::string_view::npos) return false;
    std::string pname(trim(rest.substr(0, pgt)));
    if (pname.empty()) return false;
    rest = rest.substr(pgt + 1);
    size_t pe = rest.find(pclose);
    if (pe == std::string_view::npos) return false;
    std::string_view v = rest.substr(0, pe);
    rest = rest.substr(pe + pclose.size());
    // The template writes "<parameter=P>\n" VALUE "\n</parameter>".
    if (!v.empty() && v.front() == '\n') v.remove_prefix(1);
    if (!v.empty() && v.back() == '\n') v.remove_suffix(1);
    const std::string ty = schema_type(tools, name, pname);
    json value = std::string(v);
    if (!ty.empty() && ty != "string") {
      json parsed = json::parse(v, nullptr, false);
      if (!parsed.is_discarded()) value = std::move(parsed);
    }
    args[pname] = std::move(value);
  }
  out->name = std::move(name);
  out->arguments = args.dump(-1, ' ', false, json::error_handler_t::replace);
  return true;
}

}  // namespace

bool parse_tool_call_block(std::string_view block, const json& tools, ToolCall* out) {
  std::string_view b = trim(block);
  if (b.empty()) return false;
  if (b.front() == '{') return parse_json_call(b, out);
  return parse_xml_call(b, tools, out);
}

ChatOutputParser::ChatOutputParser(Options opt)
    : opt_(std::move(opt)), mode_(opt_.in_reasoning ? Mode::Reasoning : Mode::Start) {
  strip_newlines_ = opt_.in_reasoning;  // the template's "<think>\n": the reasoning starts after it
}

void ChatOutputParser::emit_text(OutputEvent::Kind kind, std::string text, std::vector<OutputEvent>& out) {
  if (text.empty()) return;
  if (!out.empty() && out.back().kind == kind) out.back().text += text;
  else out.push_back({kind, std::move(text), {}});
}

void ChatOutputParser::emit_content(std::string text, std::vector<OutputEvent>& out) {
  if (strip_newlines_) {
    size_t n = 0;
    while (n < text.size() && text[n] == '\n') ++n;
    text.erase(0, n);
    if (text.empty()) return;
    strip_newlines_ = false;
  }
  if (text.empty()) return;
  // Trailing whitespace waits: before or between tool calls it is layout,
  // not part of the answer (and it must not depend on how the text was cut
  // into pieces).
  size_t end = text.size();
  while (end > 0 && is_space(text[end - 1])) --end;
  if (end == 0) {
    ws_pending_ += text;
    return;
  }
  emit_text(OutputEvent::Kind::Content, ws_pending_ + text.substr(0, end), out);
  ws_pending_ = text.substr(end);
}

std::vector<OutputEvent> ChatOutputParser::feed(std::string_view text) {
  std::vector<OutputEvent> out;
  buf_ += text;
  while (!buf_.empty()) {
    if (mode_ == Mode::Start) {
      // Reasoning is recognised only at the very start of the answer.
      std::string_view t = buf_;
      size_t lead = 0;
      while (lead < t.size() && is_space(t[lead])) ++lead;
      std::string_view rest = t.substr(lead);
      if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
        buf_.erase(0, lead + kThinkOpen.size());
        mode_ = Mode::Reasoning;
        strip_newlines_ = true;
        continue;
      }
      if (rest.size() < kThinkOpen.size() && kThinkOpen.substr(0, rest.size()) == rest) return out;  // may still be <think>
      mode_ = Mode::Content;
      continue;
    }
    if (mode_ == Mode::Reasoning) {
      size_t pos = buf_.find(kThinkClose);
      if (pos != std::string::npos) {
        std::string r = buf_.substr(0, pos);
        while (!r.empty() && r.back() == '\n') r.pop_back();
        if (strip_newlines_) r.erase(0, r.find_first_not_of('\n') == std::string::npos ? r.size() : r.find_first_not_of('\n'));
        emit_text(OutputEvent::Kind::Reasoning, std::move(r), out);
        buf_.erase(0, pos + kThinkClose.size());
        mode_ = Mode::Content;
        strip_newlines_ = true;
        continue;
      }
      // Release all but a possible "</think>" start and trailing newlines
      // (the template puts one before </think>).
      size_t keep = partial_tag_suffix(buf_, kThinkClose);
      size_t n = buf_.size() - keep;
      while (n > 0 && buf_[n - 1] == '\n') --n;
      std::string r = buf_.substr(0, n);
      if (strip_newlines_) {
        size_t k = r.find_first_not_of('\n');
        if (k == std::string::npos) return out;  // newlines only so far: wait
        r.erase(0, k);
        strip_newlines_ = false;
        buf_.erase(0, k);
        n -= k;
      }
      emit_text(OutputEvent::Kind::Reasoning, std::move(r), out);
      buf_.erase(0, n);
      return out;
    }
    if (mode_ == Mode::Content) {
      if (!opt_.tools) {
        emit_content(std::move(buf_), out);
        buf_.clear();
        return out;
      }
      size_t pos = buf_.find(kCallOpen);
      if (pos != std::string::npos) {
        emit_content(buf_.substr(0, pos), out);
        buf_.erase(0, pos + kCallOpen.size());
        mode_ = Mode::ToolCall;
        continue;
      }
      size_t keep = partial_tag_suffix(buf_, kCallOpen);
      emit_content(buf_.substr(0, buf_.size() - keep), out);
      buf_.erase(0, buf_.size() - keep);
      return out;
    }
    // Mode::ToolCall
    // A JSON call whose object is complete but is followed by something
    // other than </tool_call> (a model that forgot the tag): the call ends
    // with its object and the rest is read as answer text again.
    if (const size_t end = json_object_end(buf_); end != std::string::npos) {
      std::string_view after = std::string_view(buf_).substr(end);
      while (!after.empty() && is_space(after.front())) after.remove_prefix(1);
      const bool tag_next = after.substr(0, kCallClose.size()) == kCallClose;
      if (!tag_next && after.size() < kCallClose.size() && kCallClose.substr(0, after.size()) == after)
        return out;  // nothing yet, or the start of </tool_call>: wait
      ToolCall call;
      if (!tag_next && parse_tool_call_block(std::string_view(buf_).substr(0, end), opt_.tool_defs, &call)) {
        ws_pending_.clear();
        strip_newlines_ = false;
        ++calls_;
        names_.push_back(call.name);
        out.push_back({OutputEvent::Kind::ToolCall, "", std::move(call)});
        buf_.erase(0, end);
        mode_ = Mode::Content;
        continue;
      }
    }
    size_t pos = buf_.find(kCallClose);
    if (pos == std::string::npos) return out;
    const size_t resume = pos + kCallClose.size();
    ToolCall call;
    if (parse_tool_call_block(std::string_view(buf_).substr(0, pos), opt_.tool_defs, &call)) {
      ws_pending_.clear();
      strip_newlines_ = false;
      ++calls_;
      names_.push_back(call.name);
      out.push_back({OutputEvent::Kind::ToolCall, "", std::move(call)});
    } else {
      emit_content(std::string(kCallOpen) + buf_.substr(0, pos + kCallClose.size()), out);
    }
    buf_.erase(0, resume);
    mode_ = Mode::Content;
  }
  return out;
}

std::vector<OutputEvent> ChatOutputParser::finish() {
  std::vector<OutputEvent> out;
  switch (mode_) {
    case Mode::Start:
    case Mode::Content:
      emit_content(std::move(buf_), out);
      break;
    case Mode::Reasoning: {
      std::string r = std::move(buf_);
      if (strip_newlines_) r.erase(0, std::min(r.size(), r.find_first_not_of('\n')));
      emit_text(OutputEvent::Kind::Reasoning, std::move(r), out);
      break;
    }
    case Mode::ToolCall: {
      // Generation ended inside a call (an end-of-turn token right after its
      // JSON, or the token limit): a complete call still counts.
      ToolCall call;
      if (parse_tool_call_block(buf_, opt_.tool_defs, &call)) {
        ws_pending_.clear();
        ++calls_;
        names_.push_back(call.name);
        out.push_back({OutputEvent::Kind::ToolCall, "", std::move(call)});
      } else {
        emit_content(std::string(kCallOpen) + buf_, out);
      }
      break;
    }
  }
  buf_.clear();
  mode_ = Mode::Content;
  if (calls_ == 0 && !ws_pending_.empty()) emit_text(OutputEvent::Kind::Content, std::move(ws_pending_), out);
  ws_pending_.clear();
  return out;
}

}  // namespace flashmoe::server
