// Chat-template rendering: the input is "<jinja source>\x00<messages JSON>".
// Without a separator (or with invalid JSON) a fixed conversation is used.
#include <cstring>

#include "core/error.h"
#include "tokenizer/chat_template.h"

using ojson = nlohmann::ordered_json;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  const char* sep = static_cast<const char*>(std::memchr(p, 0, size));
  std::string source(p, sep ? size_t(sep - p) : size);
  ojson messages = ojson::array({{{"role", "system"}, {"content", "be brief"}},
                                 {{"role", "user"}, {"content", "hi <|im_end|>"}},
                                 {{"role", "assistant"}, {"content", "hello"}, {"reasoning_content", "think"}}});
  if (sep) {
    ojson m = ojson::parse(sep + 1, p + size, nullptr, false);
    if (!m.is_discarded()) messages = std::move(m);
  }
  try {
    flashmoe::ChatTemplate t(source, ojson{{"eos_token", "<|im_end|>"}, {"bos_token", nullptr}});
    t.render(messages, true);
    t.render(messages, false, false, ojson::array({{{"type", "function"}, {"function", {{"name", "f"}}}}}));
  } catch (const flashmoe::Error&) {
  }
  return 0;
}
