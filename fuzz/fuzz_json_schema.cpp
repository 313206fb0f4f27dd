// response_format schemas from clients: the schema compiler, then the
// matcher and the token constraint over the text after the first NUL byte
// (input: "schema\0text"), on a vocabulary of every single byte plus a few
// longer tokens.
#include <cstring>

#include "engine/json_schema_grammar.h"
#include "engine/token_constraint.h"

namespace {

std::shared_ptr<const flashmoe::TokenVocabulary> vocabulary() {
  static const auto trie = [] {
    std::vector<std::string> pieces;
    for (int b = 0; b < 256; ++b) pieces.push_back(std::string(1, char(b)));
    for (const char* t : {"{\"", "\":", "\", \"", "true", "null", "\\u00", "\xC3\xA9", "12", "]}", "\"}"})
      pieces.push_back(t);
    return std::make_shared<const flashmoe::TokenVocabulary>(std::move(pieces));
  }();
  return trie;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* begin = reinterpret_cast<const char*>(data);
  const char* nul = static_cast<const char*>(std::memchr(begin, 0, size));
  const std::string schema(begin, nul ? nul : begin + size);
  const std::string text = nul ? std::string(nul + 1, begin + size) : std::string();
  nlohmann::ordered_json rf = {{"type", "json_schema"}};
  try {
    rf["json_schema"]["schema"] = nlohmann::ordered_json::parse(schema);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  try {
    auto c = flashmoe::make_json_constraint(rf, vocabulary());
    auto* g = static_cast<flashmoe::GrammarConstraint*>(c.get());
    std::vector<float> logits(vocabulary()->vocab_size() + 2);
    int64_t budget = 40;
    for (unsigned char b : text) {
      const auto& allowed = g->allowed();
      if (!((allowed[b >> 6] >> (b & 63)) & 1)) break;
      g->mask(logits, std::vector<int32_t>{int32_t(vocabulary()->vocab_size())}, budget--);
      g->accept(b);  // the single-byte token b
      (void)g->bytes_to_complete();
    }
  } catch (const flashmoe::Error&) {
    // JsonSchemaError: a schema refused with a message; Error: too many open parses
  }
  return 0;
}
