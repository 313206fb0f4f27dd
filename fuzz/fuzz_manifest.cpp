// Packed-expert manifest parsing against the tiny-qwen35moe config (layer
// files are looked up in a directory that does not exist).
#include "core/error.h"
#include "experts/manifest.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const flashmoe::ModelConfig cfg =
      flashmoe::load_model_config(flashmoe::fuzz::source_path("tests/fixtures/tiny-qwen35moe/model"));
  try {
    auto m = flashmoe::parse_manifest(std::string(reinterpret_cast<const char*>(data), size),
                                      "/nonexistent/flashmoe-fuzz", cfg);
    m.total_expert_bytes();
  } catch (const flashmoe::Error&) {
  }
  return 0;
}
