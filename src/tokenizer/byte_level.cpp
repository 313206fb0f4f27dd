#include "tokenizer/byte_level.h"

#include "tokenizer/utf8.h"

namespace flashmoe::byte_level {

namespace {

struct Tables {
  std::array<std::string, 256> to_unicode;
  std::array<int, 324> to_byte;  // code points used are all < 324
  Tables() {
    to_byte.fill(-1);
    std::array<char32_t, 256> cp{};
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) cp[b] = printable[b] ? char32_t(b) : char32_t(256 + n++);
    for (int b = 0; b < 256; ++b) {
      utf8::append(to_unicode[b], cp[b]);
      to_byte[cp[b]] = b;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

const std::string& byte_to_unicode(unsigned char b) { return tables().to_unicode[b]; }

int unicode_to_byte(char32_t cp) { return cp < 324 ? tables().to_byte[cp] : -1; }

std::string decode_token(std::string_view token) {
  if (utf8::find_invalid(token) != utf8::npos) return std::string(token);
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const int b = unicode_to_byte(utf8::next(token, i));
    if (b < 0) return std::string(token);
    out += char(b);
  }
  return out;
}

std::string encode_bytes(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) out += byte_to_unicode(b);
  return out;
}

}  // namespace flashmoe::byte_level
