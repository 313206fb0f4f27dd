// Regression tests for inputs the libFuzzer targets in fuzz/ found crashing:
// each must now fail with flashmoe::Error (or be accepted), never abort.
#include <gtest/gtest.h>

#include <string>

#include <fstream>
#include <functional>

#include "core/error.h"
#include "test_util.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace reliability_test {

namespace {

using flashmoe::ChatTemplate;
using ojson = nlohmann::ordered_json;

const ojson kMessages = ojson::array({{{"role", "user"}, {"content", "hi"}}});

// fuzz_chat_template: an integer literal past INT64_MAX made std::stoll throw
// std::out_of_range out of the template parser (uncaught: std::terminate).
TEST(FuzzRegression, ChatTemplateHugeIntegerLiteral) {
  EXPECT_THROW(ChatTemplate("{{ 99999999999999999999 }}"), flashmoe::Error);
  EXPECT_THROW(ChatTemplate("{{ 1" + std::string(400, '0') + ".5 }}"), flashmoe::Error);
  EXPECT_EQ(ChatTemplate("{{ 9223372036854775807 }}").render(kMessages, false), "9223372036854775807");
}

// Recursion depth: each of these overflowed the stack (ASan stack-overflow
// in the parser, the evaluator or the AST destructors) before the nesting
// limits in jinja.cpp.
TEST(FuzzRegression, ChatTemplateDeepNestingIsAnError) {
  const std::string parens = "{{ " + std::string(20000, '(') + "1" + std::string(20000, ')') + " }}";
  EXPECT_THROW(ChatTemplate{parens}, flashmoe::Error);
  std::string chain = "{{ ";
  for (int i = 0; i < 50000; ++i) chain += "1+";
  EXPECT_THROW(ChatTemplate(chain + "1 }}"), flashmoe::Error);
  EXPECT_THROW(ChatTemplate("{{ " + std::string(20000, '-') + "1 }}"), flashmoe::Error);
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  ifs += "x";
  for (int i = 0; i < 5000; ++i) ifs += "{% endif %}";
  EXPECT_THROW(ChatTemplate{ifs}, flashmoe::Error);
  ChatTemplate rec("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}");
  EXPECT_THROW(rec.render(kMessages, false), flashmoe::Error);
  // Ordinary nesting still works.
  EXPECT_EQ(ChatTemplate("{{ ((((1 + 2)))) * -(-3) }}").render(kMessages, false), "9");
  std::string chain100 = "{{ 0";
  for (int i = 0; i < 100; ++i) chain100 += "+1";
  EXPECT_EQ(ChatTemplate(chain100 + " }}").render(kMessages, false), "100");
}

}  // namespace

// fuzz_tokenizer_load: a token id written as a float beyond int's range
// (3.4e108) was converted with undefined behaviour, and an integer id past
// 2^31 was silently truncated into another id. Both are errors now.
TEST(FuzzRegression, TokenizerIdsOutsideInt32AreAnError) {
  std::ifstream in(flashmoe::test::source_path("models/coder-mini/tokenizer.json"));
  const nlohmann::json good = nlohmann::json::parse(in);
  flashmoe::test::TempDir dir;
  auto load_with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    const std::string path = dir.path + "/tokenizer.json";
    std::ofstream(path) << j.dump();
    return flashmoe::Tokenizer::load(path);
  };
  const std::string key = good["model"]["vocab"].begin().key();
  EXPECT_THROW(load_with([&](nlohmann::json& j) { j["model"]["vocab"][key] = 3.44444e108; }), flashmoe::Error);
  EXPECT_THROW(load_with([&](nlohmann::json& j) { j["model"]["vocab"][key] = 1.5; }), flashmoe::Error);
  EXPECT_THROW(load_with([&](nlohmann::json& j) { j["model"]["vocab"][key] = (int64_t(1) << 32) + 5; }), flashmoe::Error);
  EXPECT_THROW(load_with([&](nlohmann::json& j) { j["model"]["vocab"][key] = -1; }), flashmoe::Error);
  ASSERT_TRUE(good.contains("added_tokens") && !good["added_tokens"].empty());
  EXPECT_THROW(load_with([&](nlohmann::json& j) { j["added_tokens"][0]["id"] = 1e300; }), flashmoe::Error);
  EXPECT_NO_THROW(load_with([](nlohmann::json&) {}));
}

}  // namespace reliability_test
