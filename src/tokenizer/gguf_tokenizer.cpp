#include "tokenizer/gguf_tokenizer.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace flashmoe {

using json = nlohmann::json;

namespace {

// The Split regexes of the HF tokenizer.json files that llama.cpp's
// converter names "qwen2" (Qwen2 / Qwen3) and "qwen35" (Qwen3.5: letters
// include combining marks \p{M}).
const char* kQwen2Split =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* kQwen35Split =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

constexpr int64_t kControl = 3, kUserDefined = 4, kUnused = 5;

const GgufValue& string_array(const GgufModel& g, const std::string& key) {
  const GgufValue& v = g.get(key);
  if (v.type != GgufValueType::Array || v.elem != GgufValueType::String)
    fail(g.path() + ": GGUF metadata '" + key + "' must be an array of strings");
  return v;
}

std::string token_text(const GgufModel& g, const std::string& key) {
  if (!g.has(key)) return "";
  const int64_t id = g.get_int(key);
  const GgufValue& toks = g.get("tokenizer.ggml.tokens");
  if (id < 0 || size_t(id) >= toks.strings.size()) return "";
  return toks.strings[size_t(id)];
}

}  // namespace

Tokenizer gguf_tokenizer(const GgufModel& g) {
  const std::string& src = g.path();
  const std::string model = g.get_string("tokenizer.ggml.model");
  if (model != "gpt2")
    fail(src + ": tokenizer.ggml.model '" + model + "' is not supported (flashmoe reads byte-level BPE, 'gpt2')");
  const std::string pre = g.has("tokenizer.ggml.pre") ? g.get_string("tokenizer.ggml.pre") : "";
  const char* split = pre == "qwen2" ? kQwen2Split : pre == "qwen35" ? kQwen35Split : nullptr;
  if (!split)
    fail(src + ": tokenizer.ggml.pre '" + pre + "' is not supported (flashmoe reads the Qwen pre-tokenizers qwen2, qwen35)");
  const GgufValue& tokens = string_array(g, "tokenizer.ggml.tokens");
  const GgufValue& merges = string_array(g, "tokenizer.ggml.merges");
  std::vector<int64_t> types(tokens.strings.size(), 1);
  if (const GgufValue* tt = g.find("tokenizer.ggml.token_type")) {
    if (tt->type != GgufValueType::Array || tt->ints.size() != tokens.strings.size())
      fail(src + ": tokenizer.ggml.token_type must give a type per token");
    types = tt->ints;
  }

  json vocab = json::object(), added = json::array();
  for (size_t id = 0; id < tokens.strings.size(); ++id) {
    const std::string& t = tokens.strings[id];
    if (types[id] == kControl || types[id] == kUserDefined) {
      added.push_back({{"id", id}, {"content", t}, {"special", types[id] == kControl}, {"lstrip", false},
                       {"rstrip", false}, {"normalized", false}, {"single_word", false}});
    } else if (types[id] != kUnused) {  // unused: padding entries like "[PAD151669]"
      vocab[t] = id;
    }
  }
  json j = {
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"}, {"pattern", {{"Regex", split}}}, {"behavior", "Isolated"}, {"invert", false}},
                      {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}})}}},
      {"model", {{"type", "BPE"}, {"vocab", std::move(vocab)}, {"merges", merges.strings}, {"byte_fallback", false}}},
      {"added_tokens", std::move(added)},
  };
  return Tokenizer::from_json(j, src);
}

std::optional<ChatTemplate> gguf_chat_template(const GgufModel& g) {
  if (!g.has("tokenizer.chat_template")) return std::nullopt;
  nlohmann::ordered_json specials = nlohmann::ordered_json::object();
  for (auto [var, key] : {std::pair{"bos_token", "tokenizer.ggml.bos_token_id"}, {"eos_token", "tokenizer.ggml.eos_token_id"},
                          {"pad_token", "tokenizer.ggml.padding_token_id"}, {"unk_token", "tokenizer.ggml.unknown_token_id"}}) {
    const std::string t = token_text(g, key);
    if (!t.empty()) specials[var] = t;
  }
  try {
    return ChatTemplate(g.get_string("tokenizer.chat_template"), specials);
  } catch (const Error& e) {
    fail(std::string(e.what()) + " (template from " + g.path() + ")");
  }
}

Tokenizer load_tokenizer(const std::string& path) {
  if (!is_gguf_path(path)) return Tokenizer::load(path);
  return gguf_tokenizer(GgufModel(path));
}

ChatTemplate load_chat_template(const std::string& path) {
  if (!is_gguf_path(path)) return ChatTemplate::load(path);
  std::optional<ChatTemplate> t = gguf_chat_template(GgufModel(path));
  if (!t) fail(path + ": the GGUF has no chat template (tokenizer.chat_template)");
  return std::move(*t);
}

}  // namespace flashmoe
