#include "cli/text_model.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/gguf_tokenizer.h"

namespace flashmoe::cli {

namespace {
// tokenizer_config.json's template, or none when there is no usable one:
// plain completion still works; --chat will say so.
std::optional<ChatTemplate> usable_chat_template(const std::string& tokenizer_config) {
  if (tokenizer_config.empty()) return std::nullopt;
  try {
    return ChatTemplate::load(tokenizer_config);
  } catch (const Error&) {
    return std::nullopt;
  }
}
}  // namespace

TextModel load_text_model(const ModelOptions& opt) {
  const std::string& path = opt.model_dir;
  ModelFiles files = resolve_model_files(path);
  if (!files.gguf.empty()) {
    const GgufModel g(files.gguf);
    TextModel tm{files, load_model(opt), gguf_tokenizer(g), gguf_chat_template(g)};
    return tm;
  }
  if (files.tokenizer_json.empty())
    fail("no tokenizer.json found for " + path + " (looked in the model directory and next to it)");
  Tokenizer tok = Tokenizer::load(files.tokenizer_json);
  TextModel tm{files, load_model(opt), std::move(tok), std::nullopt};
  tm.chat = usable_chat_template(files.tokenizer_config);
  return tm;
}

TextModel load_synthetic_text_model(const ModelOptions& opt, const SyntheticOptions& s, const std::string& tokenizer,
                                    std::string* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  ModelFiles files;
  files.model_dir = "synthetic " + s.name;  // names the model in messages (no chat template found for ...)
  const fs::path dir = fs::is_directory(tokenizer, ec) ? fs::path(tokenizer) : fs::path(tokenizer).parent_path();
  files.tokenizer_json = fs::is_directory(tokenizer, ec) ? (dir / "tokenizer.json").string() : tokenizer;
  if (!fs::is_regular_file(files.tokenizer_json, ec))
    fail("--tokenizer " + tokenizer + ": no tokenizer.json there (give a directory holding one, or the file)");
  if (fs::is_regular_file(dir / "tokenizer_config.json", ec)) files.tokenizer_config = (dir / "tokenizer_config.json").string();
  Tokenizer tok = Tokenizer::load(files.tokenizer_json);
  TextModel tm{files, build_synthetic_model(opt, s, /*mtp_head=*/false, what), std::move(tok), std::nullopt};
  const size_t vocab = size_t(tm.backend->config().vocab_size);
  if (tm.tokenizer.vocab_size() > vocab)
    fail("--tokenizer " + tokenizer + " has " + std::to_string(tm.tokenizer.vocab_size()) +
         " token ids, more than the vocabulary of " + std::to_string(vocab) + " of --synthetic " + s.name +
         " (its prompts would hold ids the model does not have)");
  tm.tokenizer.spell_missing_ids(vocab);
  tm.chat = usable_chat_template(files.tokenizer_config);
  return tm;
}

const ChatTemplate& TextModel::chat_template() const {
  if (!chat)
    fail("no chat template found for " + files.model_dir +
         (files.gguf.empty() ? " (tokenizer_config.json with chat_template)" : " (tokenizer.chat_template)"));
  return *chat;
}

std::vector<int32_t> TextModel::eos_ids(bool chat_mode) const {
  std::vector<int32_t> ids;
  for (int64_t e : backend->config().eos_token_ids) ids.push_back(int32_t(e));
  if (chat) {
    int32_t e = tokenizer.token_id(chat->eos_token());
    if (e >= 0) ids.push_back(e);
  }
  if (chat_mode) {
    int32_t im_end = tokenizer.token_id("<|im_end|>");
    if (im_end >= 0) ids.push_back(im_end);
  }
  return ids;
}

std::string TextModel::render_user_turn(const std::string& system, const std::string& user, bool no_think) const {
  nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
  if (!system.empty()) msgs.push_back({{"role", "system"}, {"content", system}});
  msgs.push_back({{"role", "user"}, {"content", user}});
  return chat_template().render(msgs, true, no_think ? std::optional<bool>(false) : std::nullopt);
}

}  // namespace flashmoe::cli
