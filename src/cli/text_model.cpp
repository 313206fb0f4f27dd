#include "cli/text_model.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/gguf_tokenizer.h"

namespace flashmoe::cli {

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
  if (!files.tokenizer_config.empty()) {
    try {
      tm.chat.emplace(ChatTemplate::load(files.tokenizer_config));
    } catch (const Error&) {
      // No usable template: plain completion still works; --chat will say so.
    }
  }
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
