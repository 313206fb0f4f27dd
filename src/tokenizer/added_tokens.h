// Added tokens (tokenizer.json "added_tokens": <|im_start|>, <think>, ...) are
// found in the text before normalisation/BPE, exactly like HF's
// AddedVocabulary: leftmost-longest match, honouring single_word, lstrip and
// rstrip; tokens marked normalized=true are matched on normalised text
// instead (a separate matcher instance).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace flashmoe {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, normalized = false, single_word = false;
};

class AddedTokenMatcher {
 public:
  struct Segment {
    int32_t id;  // -1: plain text to be normalised and BPE-encoded
    size_t begin, end;
  };

  void build(std::vector<AddedToken> tokens);
  bool empty() const { return tokens_.empty(); }

  // Splits `text` into plain and added-token segments. With
  // split_special=true, tokens marked special are treated as plain text.
  void split(std::string_view text, bool split_special, std::vector<Segment>& out) const;

 private:
  std::vector<AddedToken> tokens_;                  // longest first
  std::vector<std::vector<uint32_t>> by_first_byte_;  // 256 buckets of token indices
};

}  // namespace flashmoe
