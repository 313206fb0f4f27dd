#include "tokenizer/utf8.h"

namespace flashmoe::utf8 {

namespace {

// How many bytes starting at s[i] follow the well-formed table (Unicode 3.9,
// table 3-7) and how many the sequence needs. matched == needed: valid.
struct Probe {
  size_t matched, needed;
};

Probe probe(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, 1};
  size_t needed;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    needed = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    needed = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    needed = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {0, 1};  // C0, C1, F5..FF, or a stray continuation byte
  }
  size_t matched = 1;
  for (size_t k = 1; k < needed && i + k < s.size(); ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
    ++matched;
  }
  return {matched, needed};
}

}  // namespace

size_t valid_sequence_length(std::string_view s, size_t i) {
  const Probe p = probe(s, i);
  return p.matched == p.needed ? p.needed : 0;
}

size_t find_invalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = valid_sequence_length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return npos;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

char32_t next(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  const size_t n = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  char32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

std::string repair(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const Probe p = probe(s, i);
    if (p.matched == p.needed) {
      out.append(s.data() + i, p.needed);
      i += p.needed;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD for the maximal subpart
      i += p.matched == 0 ? 1 : p.matched;
    }
  }
  return out;
}

size_t complete_prefix_length(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const Probe p = probe(s, i);
    if (p.matched == p.needed) {
      i += p.needed;
    } else if (p.matched > 0 && i + p.matched == s.size()) {
      return i;  // a valid start cut short by the end: wait for more bytes
    } else {
      i += p.matched == 0 ? 1 : p.matched;
    }
  }
  return s.size();
}

bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

}  // namespace flashmoe::utf8
