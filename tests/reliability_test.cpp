// Regression tests for inputs the libFuzzer targets in fuzz/ found crashing:
// each must now fail with flashmoe::Error (or be accepted), never abort.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "tokenizer/chat_template.h"

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
