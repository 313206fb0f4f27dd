// `flashmoe chat-template`: renders chat prompts with the model's Jinja chat
// template; one JSON request object per stdin line -> one JSON string per line.
#include <memory>

#include "cli/command.h"
#include "cli/jsonl_io.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/gguf_tokenizer.h"

namespace flashmoe::cli {
namespace {

void setup_chat_template(CLI::App& app) {
  auto model = std::make_shared<std::string>();
  auto* sub = app.add_subcommand(
      "chat-template",
      "Render prompts: {messages, add_generation_prompt, enable_thinking, tools} per stdin line -> JSON string");
  sub->add_option("-m,--model", *model, "Model directory, tokenizer_config.json or .gguf file")->required();
  sub->callback([model] {
    const ChatTemplate tmpl = load_chat_template(*model);
    for_each_json_line([&](size_t n, const nlohmann::ordered_json& j) {
      const std::string where = "stdin line " + std::to_string(n) + ": ";
      if (!j.is_object() || !j.contains("messages")) fail(where + "expected a JSON object with \"messages\"");
      const auto flag = [&](const char* key) -> std::optional<bool> {
        if (!j.contains(key) || j[key].is_null()) return std::nullopt;
        if (!j[key].is_boolean()) fail(where + "\"" + key + "\" must be true, false or null");
        return j[key].get<bool>();
      };
      std::string out;
      try {
        out = tmpl.render(j["messages"], flag("add_generation_prompt").value_or(false), flag("enable_thinking"),
                          j.value("tools", nlohmann::ordered_json()));
      } catch (const Error& e) {
        fail(where + e.what());
      }
      write_line(nlohmann::ordered_json(out).dump());
    });
  });
}

const Registrar reg_chat_template(52, setup_chat_template);

}  // namespace
}  // namespace flashmoe::cli
