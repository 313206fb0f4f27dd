#include "server/chat_prompt.h"

#include "core/error.h"

namespace flashmoe::server {

using json = nlohmann::ordered_json;

namespace {

bool ends_with(const std::string& s, const std::string& t) {
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

}  // namespace

ChatPrompt build_chat_prompt(const ChatTemplate& tmpl, const CompletionRequest& q) {
  ChatPrompt p;
  const bool have_tools = q.tools.is_array() && !q.tools.empty();
  const std::string& src = tmpl.source();
  // Qwen3.5 / Qwen3-Coder templates write calls as <function=NAME>; Qwen3's
  // as a JSON object.
  p.syntax = src.find("<function=") != std::string::npos ? ToolSyntax::Xml : ToolSyntax::Json;
  bool template_takes_tools = src.find("tools") != std::string::npos && src.find("<tool_call>") != std::string::npos;
  bool mentions_calls = false;
  for (const auto& m : q.messages)
    if (m.contains("tool_calls") || m["role"] == "tool") mentions_calls = true;
  if ((have_tools || mentions_calls) && !template_takes_tools)
    throw ApiError(400, "this model's chat template has no tool support (no tools, tool calls or tool messages)",
                   "invalid_request_error", "", have_tools ? "tools" : "messages");
  const json tools = have_tools && q.tool_choice != ToolChoice::None ? q.tools : json();
  p.tools = !tools.is_null();
  try {
    p.text = tmpl.render(q.messages, true, std::nullopt, tools, q.template_kwargs);
    p.head = tmpl.render(q.messages, false, std::nullopt, tools, q.template_kwargs);
  } catch (const Error&) {
    throw ApiError(400, "the chat template could not be applied to these messages", "invalid_request_error", "",
                   "messages");
  }
  p.in_reasoning = ends_with(p.text, "<think>\n") || ends_with(p.text, "<think>");
  if (p.tools && (q.tool_choice == ToolChoice::Required || q.tool_choice == ToolChoice::Named)) {
    // A forced call skips the reasoning: close it as the template does for
    // enable_thinking=false.
    if (p.in_reasoning) p.prefill = ends_with(p.text, "\n") ? "\n</think>\n\n" : "\n\n</think>\n\n";
    const bool named = q.tool_choice == ToolChoice::Named;
    if (p.syntax == ToolSyntax::Xml)
      p.prefill += named ? "<tool_call>\n<function=" + q.tool_name + ">\n" : std::string("<tool_call>\n<function=");
    else
      p.prefill += named ? "<tool_call>\n{\"name\": " + json(q.tool_name).dump() + ", \"arguments\": "
                         : std::string("<tool_call>\n{\"name\": \"");
    p.text += p.prefill;
  }
  return p;
}

}  // namespace flashmoe::server
