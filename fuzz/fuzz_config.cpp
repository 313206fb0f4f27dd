// config.json parsing (parse_model_config, and the quantisation keys:
// parse_quantization_config) on arbitrary text.
#include "core/error.h"
#include "format/config.h"
#include "format/quantization_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    flashmoe::parse_model_config(text, "fuzz/config.json");
  } catch (const flashmoe::Error&) {
  }
  try {
    flashmoe::parse_quantization_config(text, "fuzz/config.json");
  } catch (const flashmoe::Error&) {
  }
  return 0;
}
