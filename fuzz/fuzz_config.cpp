// config.json parsing (parse_model_config) on arbitrary text.
#include "core/error.h"
#include "format/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    flashmoe::parse_model_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz/config.json");
  } catch (const flashmoe::Error&) {
  }
  return 0;
}
