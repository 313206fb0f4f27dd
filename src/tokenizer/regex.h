// A compiled PCRE2 pattern (UTF + UCP so \p{L}, \s etc. are Unicode-aware,
// as in the Oniguruma regexes HF tokenizers uses), JIT-compiled when the
// platform supports it. Used by the Split pre-tokeniser.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace flashmoe {

class Regex {
 public:
  explicit Regex(const std::string& pattern);  // throws flashmoe::Error
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping leftmost matches of the pattern in `text` (valid UTF-8),
  // as [begin, end) byte offsets. Empty matches are dropped.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*; kept opaque to keep pcre2.h out of headers
  bool jit_ = false;
};

}  // namespace flashmoe
