// The token-level constraint on a toy vocabulary: at each step the allowed
// set is derived by hand (which tokens' bytes keep the text a prefix of a
// value of the schema), including tokens that span several grammar pieces
// and partial UTF-8 characters; the masking of logits, EOS only at the end,
// and the budget rule that keeps a value completable.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/error.h"
#include "engine/json_schema_grammar.h"
#include "engine/token_constraint.h"

namespace token_constraint_test {

using namespace flashmoe;
using json = nlohmann::ordered_json;

namespace {

// id -> bytes; "" = a token the grammar never allows (special or empty).
const std::vector<std::string> kToy = {
    "{",          // 0
    "}",          // 1
    "\"",         // 2
    "a",          // 3
    "\":",        // 4
    " ",          // 5
    "{\"",        // 6
    "1",          // 7
    "12",         // 8
    ",",          // 9
    "x",          // 10
    "",           // 11
    "true",       // 12
    "}}",         // 13
    "\"a\":",     // 14
    "",           // 15: EOS (special: not in the trie)
    "\xC3",       // 16: the first byte of "é"
    "\xA9",       // 17: its second byte
    "1}",         // 18
};
constexpr int32_t kEos = 15;

std::set<int32_t> ids(const std::vector<uint64_t>& bits) {
  std::set<int32_t> s;
  for (size_t i = 0; i < bits.size() * 64; ++i)
    if ((bits[i >> 6] >> (i & 63)) & 1) s.insert(int32_t(i));
  return s;
}

GrammarConstraint constraint(const char* schema) {
  return GrammarConstraint(std::make_shared<const Grammar>(json_schema_grammar(json::parse(schema))),
                           std::make_shared<const TokenVocabulary>(kToy));
}

const char* kObject = R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})";

}  // namespace

TEST(TokenConstraint, TrieHoldsEveryTokenOnce) {
  const TokenVocabulary t(kToy);
  std::multiset<int32_t> seen;
  for (const auto& n : t.all().nodes)
    for (int32_t id : t.all().tokens(n)) seen.insert(id);
  EXPECT_EQ(seen, (std::multiset<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 16, 17, 18}));
  EXPECT_EQ(t.all().max_depth, 4u);
  // Plain string characters (by count), and the rest in the second trie.
  std::multiset<std::pair<int32_t, uint32_t>> plain;
  for (const auto& p : t.plain()) plain.insert({p.id, p.chars});
  EXPECT_EQ(plain, (std::multiset<std::pair<int32_t, uint32_t>>{
                       {0, 1}, {1, 1}, {3, 1}, {5, 1}, {7, 1}, {8, 2}, {9, 1}, {10, 1}, {12, 4}, {13, 2}, {18, 2}}));
  std::multiset<int32_t> rest;
  for (const auto& n : t.not_plain().nodes)
    for (int32_t id : t.not_plain().tokens(n)) rest.insert(id);
  EXPECT_EQ(rest, (std::multiset<int32_t>{2, 4, 6, 14, 16, 17}));
  uint32_t chars = 0;
  EXPECT_TRUE(plain_string_chars("\xC3\xA9t\xE2\x82\xAC", chars));
  EXPECT_EQ(chars, 3u);
  EXPECT_FALSE(plain_string_chars("a\\n", chars));
  EXPECT_FALSE(plain_string_chars("a\n", chars));
  EXPECT_FALSE(plain_string_chars("\xED\xA0\x80", chars));  // a UTF-16 surrogate in UTF-8
}

TEST(TokenConstraint, AllowedSetsStepByStep) {
  GrammarConstraint c = constraint(kObject);
  // {"a": ws integer }
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{0, 6}));
  c.accept(0);
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{2, 14}));
  c.accept(14);
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{5, 7, 8, 18}));
  c.accept(8);
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{1, 7, 8, 18}));
  EXPECT_FALSE(c.complete());
  EXPECT_THROW(c.accept(13), Error);  // "}}": the second brace has no place
  c.accept(1);
  EXPECT_TRUE(c.complete());
  EXPECT_TRUE(c.finished());
  EXPECT_TRUE(ids(c.allowed()).empty());
}

TEST(TokenConstraint, StringTokensAndPartialUtf8) {
  GrammarConstraint c = constraint(R"({"type": "string", "maxLength": 1})");
  // The opening quote, alone or with ':' as the first character.
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{2, 4}));
  c.accept(2);
  // One character then the closing quote, or the quote at once: "{\"" fits
  // (a character, then the quote), "12", "1}" and "}}" are two characters,
  // "\":" puts ':' after the value, 0xA9 alone is no character.
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{0, 1, 2, 3, 5, 6, 7, 9, 10, 16}));
  c.accept(16);
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{17}));
  c.accept(17);
  EXPECT_EQ(ids(c.allowed()), (std::set<int32_t>{2}));
}

TEST(TokenConstraint, MaskKeepsAllowedLogitsAndEosOnlyWhenComplete) {
  GrammarConstraint c = constraint(kObject);
  std::vector<float> logits(kToy.size() + 3, 1.5f);  // 3 padding ids past the vocabulary
  ASSERT_TRUE(c.mask(logits, std::vector<int32_t>{kEos}, 0));
  for (size_t i = 0; i < logits.size(); ++i)
    EXPECT_EQ(std::isinf(logits[i]), i != 0 && i != 6) << "id " << i;
  for (int32_t id : {0, 14, 7}) c.accept(id);
  logits.assign(logits.size(), 0.25f);
  ASSERT_TRUE(c.mask(logits, std::vector<int32_t>{kEos}, 0));
  EXPECT_TRUE(std::isinf(logits[kEos]));  // {"a":1 is not complete
  c.accept(1);
  logits.assign(logits.size(), 0.25f);
  ASSERT_TRUE(c.mask(logits, std::vector<int32_t>{kEos}, 0));
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_EQ(std::isinf(logits[i]), i != size_t(kEos)) << "id " << i;
  EXPECT_EQ(logits[kEos], 0.25f);
  // Complete with no EOS to end it: nothing at all is left.
  EXPECT_FALSE(c.mask(logits, {}, 0));
}

TEST(TokenConstraint, BudgetKeepsTheValueCompletable) {
  GrammarConstraint c = constraint(kObject);
  c.accept(0);
  c.accept(14);  // {"a":   then at least "0}" (2 bytes)
  EXPECT_EQ(c.bytes_to_complete(), 2u);
  // 2 tokens left: after this one, one more token (at worst 1 byte) must
  // finish: " " leaves 2 bytes to go, a digit leaves 1.
  EXPECT_EQ(ids(c.allowed_within(2)), (std::set<int32_t>{7, 8, 18}));
  // 1 token left: only "1}" completes the value.
  EXPECT_EQ(ids(c.allowed_within(1)), (std::set<int32_t>{18}));
  std::vector<float> logits(kToy.size(), 0.0f);
  ASSERT_TRUE(c.mask(logits, std::vector<int32_t>{kEos}, 1));
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_EQ(std::isinf(logits[i]), i != 18) << "id " << i;
  // Far from the end the budget changes nothing.
  EXPECT_EQ(ids(c.allowed_within(100)), ids(c.allowed()));
}

TEST(TokenConstraint, CacheServesRepeatedStates) {
  GrammarConstraint c = constraint(R"({"type": "string"})");
  c.accept(2);
  const auto first = ids(c.allowed());
  for (int k = 0; k < 5; ++k) {
    c.accept(3);  // "a" again and again: the same state inside the string
    EXPECT_EQ(ids(c.allowed()), first);
  }
  EXPECT_EQ(c.walks(), 1u);  // only the first state inside the string
  EXPECT_EQ(c.cache_hits(), 5u);
}

TEST(TokenConstraint, ResponseFormatShapes) {
  auto trie = std::make_shared<const TokenVocabulary>(kToy);
  auto make = [&](const char* rf) { return make_json_constraint(json::parse(rf), trie); };
  EXPECT_EQ(make(R"({"type": "text"})"), nullptr);
  EXPECT_NE(make(R"({"type": "json_object"})"), nullptr);
  EXPECT_NE(make(R"({"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "null"}}})"),
            nullptr);
  auto error = [&](const char* rf) {
    try {
      make(rf);
    } catch (const JsonSchemaError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(error(R"({"type": "yaml"})"),
            "'response_format.type' must be one of text, json_object, json_schema (got 'yaml')");
  EXPECT_EQ(error(R"({"type": "json_schema"})"), "'response_format.json_schema' must be an object");
  EXPECT_EQ(error(R"({"type": "json_schema", "json_schema": {"name": "x"}})"),
            "'response_format.json_schema.schema' is required");
  EXPECT_EQ(error(R"({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}})"),
            "'response_format.json_schema.name' must be a string");
  EXPECT_EQ(error(R"({"type": "json_object", "schema": {}})"),
            "'response_format.schema' is not supported with type 'json_object'");
  EXPECT_EQ(error(R"({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "a"}}})"),
            "response_format schema: the keyword 'pattern' is not supported (at #)");
  EXPECT_EQ(error(R"([1])"), "'response_format' must be an object");
}

}  // namespace token_constraint_test
