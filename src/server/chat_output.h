// Splits a chat model's generated text into what the APIs report separately:
// reasoning (`<think>...</think>`), the answer, and tool calls in either of
// the Qwen chat templates' syntaxes:
//   Qwen3 (JSON):       <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>
//   Qwen3.5 / Qwen3-Coder (XML):
//     <tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>
// Text arrives in pieces as it is generated. Reasoning and answer text are
// released as soon as they cannot be the start of a tag; a tool call is held
// until its closing tag and released whole, once its arguments are known to
// be a JSON object. A block that does not parse is released as answer text
// (the client sees what the model wrote, never a silently dropped call).
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace flashmoe::server {

enum class ToolSyntax { Json, Xml };

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object, serialised
};

struct OutputEvent {
  enum class Kind { Reasoning, Content, ToolCall };
  Kind kind = Kind::Content;
  std::string text;  // Reasoning, Content
  ToolCall call;     // ToolCall
};

// Parses one tool-call block (the text between <tool_call> and </tool_call>)
// in either syntax. `tools`: the request's OpenAI-style tools (or null), used
// to type XML parameter values: a parameter whose schema type is not
// "string" is read as JSON when it parses as JSON; everything else stays a
// string. Returns false when the block is neither syntax.
bool parse_tool_call_block(std::string_view block, const nlohmann::ordered_json& tools, ToolCall* out);

class ChatOutputParser {
 public:
  struct Options {
    bool in_reasoning = false;  // the prompt ended inside <think> (Qwen3.5's generation prompt)
    bool tools = false;         // look for tool calls (off: <tool_call> is ordinary text)
    nlohmann::ordered_json tool_defs;  // for parse_tool_call_block
  };
  explicit ChatOutputParser(Options opt);

  std::vector<OutputEvent> feed(std::string_view text);
  // End of generation: releases what was held (an unfinished tool call as text).
  std::vector<OutputEvent> finish();

  int tool_calls() const { return calls_; }
  // The names of the calls parsed so far, in order.
  const std::vector<std::string>& tool_names() const { return names_; }

 private:
  enum class Mode { Start, Reasoning, Content, ToolCall };
  void emit_text(OutputEvent::Kind kind, std::string text, std::vector<OutputEvent>& out);
  void emit_content(std::string text, std::vector<OutputEvent>& out);

  Options opt_;
  Mode mode_;
  std::string buf_;         // text not yet classified (a possible tag prefix, a tool call body)
  std::string ws_pending_;  // whitespace-only answer text, held until something follows it
  bool strip_newlines_ = false;  // after </think>: the template's "\n\n" is not part of the answer
  int calls_ = 0;
  std::vector<std::string> names_;
};

}  // namespace flashmoe::server
