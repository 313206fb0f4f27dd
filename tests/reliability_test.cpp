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

}  // namespace
