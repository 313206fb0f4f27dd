// Constrained sampling: which tokens may come next so that the output stays
// a sentence of a grammar (structured output, response_format).
//
// The vocabulary is a trie over the tokens' bytes; computing the allowed set
// walks it together with the grammar's stacks, dropping a whole subtree as
// soon as its prefix is refused (the approach of llama.cpp's grammar
// sampler and of outlines / xgrammar). The sets are cached per grammar
// state, so the steps inside a long string (the same state over and over)
// cost a lookup.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/grammar.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe {

// What the generate loop needs from a constraint.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Sets the logits of the tokens that may not come next to -inf. The ids in
  // `eos_ids` keep their logits only when the output so far is complete.
  // `budget` (> 0) is how many tokens may still be generated, this one
  // included: near the end only tokens after which the value can still be
  // completed in time are allowed (0: no limit).
  // Returns false when no token at all is left (the output is complete and
  // there is no EOS to end it): the caller stops there.
  virtual bool mask(std::span<float> logits, std::span<const int32_t> eos_ids, int64_t budget) = 0;
  // Advances over a token `mask` allowed (not an EOS). Throws Error for a
  // token it did not allow.
  virtual void accept(int32_t id) = 0;
  // The output so far is a complete value.
  virtual bool complete() const = 0;
  // Complete, and no token but an EOS can follow.
  virtual bool finished() const = 0;
};

// A trie over the bytes of some tokens, in preorder.
struct ByteTrie {
  struct Node {
    uint32_t subtree_end;               // index past this node's subtree
    uint32_t tokens_begin, tokens_end;  // into ids: the tokens spelled by the path to here
    uint16_t depth;                     // 1 for a token's first byte
    uint8_t byte;
  };
  std::vector<Node> nodes;
  std::vector<int32_t> ids;
  size_t max_depth = 0;
  std::span<const int32_t> tokens(const Node& n) const {
    return {ids.data() + n.tokens_begin, n.tokens_end - n.tokens_begin};
  }
};

// The vocabulary as the constraint reads it, built once per tokenizer.
// Special tokens and ids without bytes are left out (never allowed).
// Inside a string nearly every token is allowed, so walking every token
// there would be the costly case; but a token of plain characters (see
// plain_string_chars) is allowed there by its character count alone. Those
// are listed by count, and only the other few (quotes, escapes, control
// characters, parts of characters: ~4% of Qwen3's vocabulary) are walked.
class TokenVocabulary {
 public:
  explicit TokenVocabulary(const Tokenizer& tok);
  // pieces[id]: the bytes of token id; empty: never allowed.
  explicit TokenVocabulary(std::vector<std::string> pieces);
  struct Plain {
    int32_t id;
    uint32_t chars;
  };
  const ByteTrie& all() const { return all_; }              // every token
  const ByteTrie& not_plain() const { return not_plain_; }  // the tokens not in plain()
  const std::vector<Plain>& plain() const { return plain_; }  // by chars, ascending
  size_t vocab_size() const { return pieces_.size(); }  // ids 0 .. vocab_size-1
  const std::string& bytes(int32_t id) const { return pieces_[size_t(id)]; }  // empty: never allowed

 private:
  std::vector<std::string> pieces_;
  ByteTrie all_, not_plain_;
  std::vector<Plain> plain_;
};

// A TokenConstraint that keeps the output a sentence of `grammar`.
class GrammarConstraint : public TokenConstraint {
 public:
  GrammarConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> trie);
  bool mask(std::span<float> logits, std::span<const int32_t> eos_ids, int64_t budget) override;
  void accept(int32_t id) override;
  bool complete() const override { return matcher_.accepting(); }
  bool finished() const override { return matcher_.accepting() && !matcher_.can_continue(); }

  // The tokens allowed now, one bit per id (exposed for tests and the bench).
  const std::vector<uint64_t>& allowed();
  // Those of them after which the value can be completed within budget - 1
  // more tokens (a byte per token at worst). If none can, those that bring
  // completion closer. Not cached: used only for the last few tokens.
  const std::vector<uint64_t>& allowed_within(int64_t budget);
  // The fewest bytes that complete the value from here.
  uint32_t bytes_to_complete() const { return matcher_.stacks().min_bytes_to_accept(*grammar_); }
  // When the budget comes this close to bytes_to_complete(), masks check it.
  static constexpr int64_t kBudgetSlack = 32;
  // Cache statistics: how many masks were computed by a walk / found.
  size_t walks() const { return walks_; }
  size_t cache_hits() const { return hits_; }

 private:
  // Calls on_tokens(ids, stacks after them) for every token of `trie` that
  // the stacks `start` allow.
  template <class OnTokens>
  void walk(const ByteTrie& trie, const GrammarStacks& start, OnTokens&& on_tokens);
  // The stacks now, split: a string's body between characters on top / not.
  void split();

  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const TokenVocabulary> trie_;
  GrammarMatcher matcher_;
  std::unordered_map<std::string, std::shared_ptr<const std::vector<uint64_t>>> cache_;
  std::shared_ptr<const std::vector<uint64_t>> current_;
  std::vector<GrammarStacks> level_;  // walk scratch, one per trie depth
  GrammarStacks in_string_, other_;
  std::vector<uint64_t> within_, closer_;
  std::string key_;
  size_t walks_ = 0, hits_ = 0;
};

// The constraint for an OpenAI `response_format` object: {"type": "text"}
// gives nullptr; {"type": "json_object"} any JSON object; {"type":
// "json_schema", "json_schema": {"name", "schema", "strict"}} the schema
// (json_schema_grammar.h lists what is supported). Throws JsonSchemaError
// (a user error; the message names the field or keyword) for anything else.
std::unique_ptr<TokenConstraint> make_json_constraint(const nlohmann::ordered_json& response_format,
                                                      std::shared_ptr<const TokenVocabulary> trie);

}  // namespace flashmoe
