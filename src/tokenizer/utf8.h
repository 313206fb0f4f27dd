// UTF-8 helpers shared by the tokenizer: strict validation (so encode can say
// where bad input is), lossy repair with the same "maximal subpart" rule that
// Rust's String::from_utf8_lossy uses (so decode matches HF tokenizers byte for
// byte), and the "complete prefix" test the streaming detokeniser needs.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace flashmoe::utf8 {

inline constexpr size_t npos = std::string_view::npos;

// Byte offset of the first ill-formed sequence, or npos when all of s is valid.
size_t find_invalid(std::string_view s);

// Length of the well-formed sequence at s[i], or 0 when it is ill-formed or
// truncated by the end of s.
size_t valid_sequence_length(std::string_view s, size_t i);

// Appends the UTF-8 encoding of code point cp.
void append(std::string& out, char32_t cp);

// Decodes the code point at s[i] (which must be valid) and advances i.
char32_t next(std::string_view s, size_t& i);

// Replaces every maximal ill-formed subpart with U+FFFD.
std::string repair(std::string_view bytes);

// Longest prefix of s that does not end inside a sequence that more bytes
// could still complete. Ill-formed bytes count as complete (they will be
// repaired), so only a genuinely pending multi-byte character is held back.
size_t complete_prefix_length(std::string_view s);

// Unicode White_Space (what Rust's char::is_whitespace tests).
bool is_whitespace(char32_t cp);

}  // namespace flashmoe::utf8
