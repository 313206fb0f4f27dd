#include "tokenizer/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace flashmoe {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

ChatTemplate ChatTemplate::load(const std::string& path) {
  std::error_code ec;
  const bool is_dir = fs::is_directory(path, ec);
  const std::string file = is_dir ? (fs::path(path) / "tokenizer_config.json").string() : path;
  if (!fs::exists(file, ec)) fail("tokenizer_config.json not found: " + file);
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot open " + file);
  ojson cfg;
  try {
    cfg = ojson::parse(in);
  } catch (const ojson::exception& e) {
    fail("bad tokenizer_config.json (" + file + "): " + e.what());
  }
  if (!cfg.is_object()) fail("bad tokenizer_config.json (" + file + "): not a JSON object");

  std::string source;
  const ojson tmpl = cfg.value("chat_template", ojson());
  if (tmpl.is_string()) {
    source = tmpl.get<std::string>();
  } else if (tmpl.is_array()) {
    // Several named templates: the one called "default" is the chat one.
    for (const auto& t : tmpl)
      if (t.value("name", "") == "default") source = t.value("template", "");
    if (source.empty()) fail("tokenizer_config.json (" + file + ") has no chat_template named 'default'");
  } else {
    const fs::path side = fs::path(file).parent_path() / "chat_template.jinja";
    std::ifstream j(side, std::ios::binary);
    if (!j) fail("no chat_template in " + file);
    std::stringstream ss;
    ss << j.rdbuf();
    source = ss.str();
  }

  // Like transformers' special_tokens_map: token strings, given as plain
  // strings or as {"content": ...} objects; absent/null ones are not set.
  ojson specials = ojson::object();
  for (const char* k : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!cfg.contains(k)) continue;
    const ojson& v = cfg[k];
    if (v.is_string()) specials[k] = v;
    else if (v.is_object() && v.contains("content") && v["content"].is_string()) specials[k] = v["content"];
  }
  try {
    return ChatTemplate(source, specials);
  } catch (const Error& e) {
    fail(std::string(e.what()) + " (template from " + file + ")");
  }
}

ChatTemplate::ChatTemplate(const std::string& source, ojson special_tokens)
    : source_(source), tmpl_(std::make_shared<jinja::Template>(source)), specials_(std::move(special_tokens)) {}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt,
                                 std::optional<bool> enable_thinking, const ojson& tools,
                                 const ojson& extra_vars) const {
  if (!messages.is_array()) fail("chat messages must be a JSON array");
  for (size_t k = 0; k < messages.size(); ++k)
    if (!messages[k].is_object() || !messages[k].contains("role"))
      fail("chat message " + std::to_string(k) + " must be an object with a 'role'");
  jinja::Object ctx;
  for (auto it = specials_.begin(); it != specials_.end(); ++it)
    ctx.set(it.key(), jinja::Value::from_json(it.value()));
  ctx.set("messages", jinja::Value::from_json(messages));
  ctx.set("tools", jinja::Value::from_json(tools));
  ctx.set("documents", jinja::Value::none());
  ctx.set("add_generation_prompt", jinja::Value::boolean(add_generation_prompt));
  if (enable_thinking) ctx.set("enable_thinking", jinja::Value::boolean(*enable_thinking));
  if (extra_vars.is_object())
    for (auto it = extra_vars.begin(); it != extra_vars.end(); ++it)
      ctx.set(it.key(), jinja::Value::from_json(it.value()));
  return tmpl_->render(ctx);
}

std::string ChatTemplate::eos_token() const { return specials_.value("eos_token", ""); }
std::string ChatTemplate::bos_token() const { return specials_.value("bos_token", ""); }

}  // namespace flashmoe
