// A model with its tokenizer and chat template, as the text commands need it.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "cli/common.h"
#include "cli/synthetic_options.h"
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

// --synthetic with --tokenizer DIR: the synthetic model (random weights,
// as bench builds it) with DIR's tokenizer.json and chat template (its
// tokenizer_config.json, when there); ids of the model the tokenizer lacks
// decode to "<|id_N|>" (Tokenizer::spell_missing_ids). Throws Error when
// DIR holds no tokenizer.json or the tokenizer has ids beyond the model's
// vocabulary. `what` receives the model's description.
TextModel load_synthetic_text_model(const ModelOptions& opt, const SyntheticOptions& s, const std::string& tokenizer,
                                    std::string* what);

}  // namespace flashmoe::cli
