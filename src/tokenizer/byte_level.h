// The GPT-2 byte<->unicode map used by byte-level BPE: every byte gets a
// printable code point so that vocab entries are valid strings ("Ġ" is the
// space byte). Encoding works on raw bytes internally; the map is only needed
// to translate vocab strings to byte strings and back.
#pragma once
#include <array>
#include <string>
#include <string_view>

namespace flashmoe::byte_level {

// UTF-8 text of the code point standing for byte b.
const std::string& byte_to_unicode(unsigned char b);

// The byte that code point cp stands for, or -1 when cp is not in the map.
int unicode_to_byte(char32_t cp);

// Vocab string -> raw bytes. When some character is outside the map the token
// is returned as-is (what HF's ByteLevel decoder does, e.g. for added tokens).
std::string decode_token(std::string_view token);

// Raw bytes -> vocab string.
std::string encode_bytes(std::string_view bytes);

}  // namespace flashmoe::byte_level
