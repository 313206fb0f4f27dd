// GGUF parsing: arbitrary bytes as a whole .gguf file, then the model config
// and the tokenizer built from its metadata.
#include "core/error.h"
#include "format/gguf.h"
#include "format/gguf_config.h"
#include "fuzz_util.h"
#include "tokenizer/gguf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  flashmoe::fuzz::MemFile f(data, size);
  try {
    flashmoe::GgufModel g(f.path());
    for (const auto& kv : g.tensors()) {
      // Touch the first and last byte the header promises.
      const flashmoe::GgufTensor& t = *kv.second;
      if (t.nbytes) {
        volatile uint8_t a = t.data[0];
        volatile uint8_t b = t.data[t.nbytes - 1];
        (void)a, (void)b;
      }
    }
    try {
      flashmoe::gguf_model_config(g);
    } catch (const flashmoe::Error&) {
    }
    try {
      flashmoe::gguf_tokenizer(g);
    } catch (const flashmoe::Error&) {
    }
  } catch (const flashmoe::Error&) {
  }
  return 0;
}
