// Encoding arbitrary bytes with the coder-mini tokenizer (first byte picks
// split_special); checks the round trip and the stream decoder.
#include "core/error.h"
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const flashmoe::Tokenizer tok =
      flashmoe::Tokenizer::load(flashmoe::fuzz::source_path("models/coder-mini/tokenizer.json"));
  if (size == 0) return 0;
  const bool split_special = data[0] & 1;
  std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text, split_special);
  } catch (const flashmoe::Error&) {
    return 0;  // invalid UTF-8
  }
  // The normaliser is NFC, so decode(encode(x)) is NFC(x), not x; but a
  // second round trip must be exact (byte-level BPE loses nothing).
  std::string back = tok.decode(ids);
  if (tok.decode(tok.encode(back, split_special)) != back) __builtin_trap();
  flashmoe::StreamDecoder sd(tok);
  std::string streamed;
  for (int32_t id : ids) streamed += sd.feed(id);
  streamed += sd.flush();
  if (streamed != back) __builtin_trap();
  return 0;
}
