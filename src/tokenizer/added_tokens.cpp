#include "tokenizer/added_tokens.h"

#include <utf8proc.h>

#include <algorithm>

#include "tokenizer/utf8.h"

namespace flashmoe {

namespace {

bool is_word_char(char32_t c) {
  if (c == '_') return true;
  const auto cat = utf8proc_category(utf8proc_int32_t(c));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

// Code point ending just before byte offset `pos` (pos > 0, valid UTF-8).
char32_t char_before(std::string_view s, size_t pos) {
  size_t b = pos - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return utf8::next(s, b);
}

}  // namespace

void AddedTokenMatcher::build(std::vector<AddedToken> tokens) {
  tokens.erase(std::remove_if(tokens.begin(), tokens.end(), [](const AddedToken& t) { return t.content.empty(); }),
               tokens.end());
  // Stable by length, longest first: the first candidate that matches at a
  // position is then the longest one.
  std::stable_sort(tokens.begin(), tokens.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  tokens_ = std::move(tokens);
  by_first_byte_.assign(256, {});
  for (uint32_t i = 0; i < tokens_.size(); ++i)
    by_first_byte_[static_cast<unsigned char>(tokens_[i].content[0])].push_back(i);
}

void AddedTokenMatcher::split(std::string_view text, bool split_special, std::vector<Segment>& out) const {
  if (tokens_.empty()) {
    if (!text.empty()) out.push_back({-1, 0, text.size()});
    return;
  }
  size_t plain_start = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    {
      for (uint32_t k : by_first_byte_[static_cast<unsigned char>(text[i])]) {
        const AddedToken& t = tokens_[k];
        if (split_special && t.special) continue;
        if (text.compare(i, t.content.size(), t.content) != 0) continue;
        if (t.single_word) {
          const size_t e = i + t.content.size();
          size_t j = e;
          if (i > 0 && is_word_char(char_before(text, i))) continue;
          if (e < text.size() && is_word_char(utf8::next(text, j))) continue;
        }
        hit = &t;
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t b = i, e = i + hit->content.size();
    if (hit->lstrip) {
      // Absorb whitespace to the left, but never text already consumed.
      while (b > plain_start && utf8::is_whitespace(char_before(text, b))) {
        size_t cb = b - 1;
        while (cb > 0 && (static_cast<unsigned char>(text[cb]) & 0xC0) == 0x80) --cb;
        b = cb;
      }
    }
    if (hit->rstrip) {
      while (e < text.size()) {
        size_t j = e;
        if (!utf8::is_whitespace(utf8::next(text, j))) break;
        e = j;
      }
    }
    if (b > plain_start) out.push_back({-1, plain_start, b});
    out.push_back({hit->id, b, e});
    plain_start = i = e;
  }
  if (plain_start < text.size()) out.push_back({-1, plain_start, text.size()});
}

}  // namespace flashmoe
