// A model with its tokenizer and chat template, as the text commands need it.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "cli/common.h"
#include "format/model_files.h"
#include "runtime/backend.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe::cli {

struct TextModel {
  ModelFiles files;
  std::unique_ptr<Backend> backend;  // runs the model (runtime/device.h chose it)
  Tokenizer tokenizer;
  std::optional<ChatTemplate> chat;  // absent when there is no tokenizer_config.json template

  const ChatTemplate& chat_template() const;  // throws Error when absent
  // EOS ids beyond generation_config.json's: the config's, the template's
  // eos_token, and with chat the end-of-turn token <|im_end|>.
  std::vector<int32_t> eos_ids(bool chat_mode) const;
  std::string render_user_turn(const std::string& system, const std::string& user, bool no_think) const;
};

// Throws Error naming what is missing (model dir, tokenizer.json).
TextModel load_text_model(const ModelOptions& opt);

}  // namespace flashmoe::cli
