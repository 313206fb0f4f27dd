// tokenizer.json "pre_tokenizer": splits normalised text into words that BPE
// then encodes independently. Supports what byte-level BPE files use: Split
// (regex or literal, Isolated/Removed), ByteLevel (optional GPT-2 regex and
// prefix space) and Sequence of those. Anything else is a clear Error rather
// than a silently different tokenisation.
#pragma once
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/regex.h"

namespace flashmoe {

class PreTokenizer {
 public:
  // `pt` may be null (no pre-tokenisation: the whole text is one word).
  void load(const nlohmann::json& pt);

  // Appends the words of `text`. Views point into `text` or into `storage`
  // (for words the pre-tokeniser had to build, e.g. with a prefix space).
  void split(std::string_view text, std::vector<std::string_view>& words,
             std::deque<std::string>& storage) const;

  bool has_byte_level() const { return byte_level_; }

 private:
  enum class Behavior { Isolated, Removed };
  struct Step {
    bool is_byte_level = false;
    bool add_prefix_space = false;
    std::unique_ptr<Regex> regex;  // null: no splitting in this step
    Behavior behavior = Behavior::Isolated;
  };
  void add_step(const nlohmann::json& pt);
  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace flashmoe
