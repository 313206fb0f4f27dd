// tokenizer.json loading on arbitrary bytes; a loaded tokenizer also encodes
// and decodes a fixed string.
#include "core/error.h"
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  flashmoe::fuzz::MemFile f(data, size);
  try {
    flashmoe::Tokenizer tok = flashmoe::Tokenizer::load(f.path());
    auto ids = tok.encode("Hello, world! <|im_start|> 123 ünïcødé\n\n  x", false);
    tok.decode(ids);
    ids.push_back(-1);
    ids.push_back(int32_t(tok.vocab_size()));
    tok.decode(ids, true);
  } catch (const flashmoe::Error&) {
  }
  return 0;
}
