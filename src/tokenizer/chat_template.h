// Chat prompt rendering with the model's own Jinja chat template (from
// tokenizer_config.json), evaluated by our Jinja subset interpreter with the
// same variables transformers' apply_chat_template passes.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "tokenizer/jinja.h"

namespace flashmoe {

class ChatTemplate {
 public:
  // `path`: tokenizer_config.json or a directory holding it (a
  // chat_template.jinja file next to it is used when the config has none).
  // Throws Error when there is no template or it cannot be parsed.
  static ChatTemplate load(const std::string& path);

  // `special_tokens`: bos_token/eos_token/... variables visible to the template.
  ChatTemplate(const std::string& source, nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object());

  // messages: [{role, content, (reasoning_content, tool_calls, ...)}].
  // enable_thinking: nullopt = not passed to the template at all.
  // tools: null = no tools.
  // extra_vars: more template variables (a request's chat_template_kwargs),
  // set last, so they override enable_thinking.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     std::optional<bool> enable_thinking = std::nullopt,
                     const nlohmann::ordered_json& tools = nullptr,
                     const nlohmann::ordered_json& extra_vars = nlohmann::ordered_json::object()) const;

  const std::string& source() const { return source_; }
  // "" when the config does not name one.
  std::string eos_token() const;
  std::string bos_token() const;

 private:
  std::string source_;
  std::shared_ptr<jinja::Template> tmpl_;
  nlohmann::ordered_json specials_;
};

}  // namespace flashmoe
