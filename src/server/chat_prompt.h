// A chat request's prompt: the model's chat template applied to the
// messages, with the tools (unless tool_choice is none) and the request's
// chat_template_kwargs, plus what tool_choice required/named forces.
#pragma once
#include <string>

#include "server/chat_output.h"
#include "server/openai_api.h"
#include "tokenizer/chat_template.h"

namespace flashmoe::server {

struct ChatPrompt {
  std::string text;      // the whole prompt (ends with `prefill`)
  std::string head;      // the messages without the generation prompt (the snapshot point)
  // tool_choice required / named: the start of a tool call appended to the
  // generation prompt, so the model continues inside a call (for a named
  // one, inside its arguments). The output parser is fed it first.
  std::string prefill;
  ToolSyntax syntax = ToolSyntax::Json;  // the template's tool-call syntax
  bool in_reasoning = false;  // the generation prompt opens <think> (Qwen3.5)
  bool tools = false;         // tool calls are parsed from the output
};

// Throws ApiError(400) when the template cannot take these messages or has
// no tool support while the request has tools.
ChatPrompt build_chat_prompt(const ChatTemplate& tmpl, const CompletionRequest& q);

}  // namespace flashmoe::server
