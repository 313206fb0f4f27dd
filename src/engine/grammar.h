// A byte-level context-free grammar and the pushdown matcher that runs it,
// for constrained sampling (structured output). The grammar is what
// json_schema_grammar.cpp compiles a JSON Schema into; the matcher follows
// every way the bytes so far can be parsed at once (a set of stacks, as in
// llama.cpp's GBNF sampler), so alternatives that share a prefix (anyOf,
// optional properties) need no lookahead.
#pragma once
#include <bitset>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace flashmoe {

struct Grammar {
  enum class Op : uint8_t {
    End,    // ends an alternative
    Bytes,  // one byte from byte_sets[arg]
    Ref,    // the rule `arg`
    String  // a JSON string's body and its closing quote: between min and max
            // characters (code points; an escape is one), valid UTF-8, no raw
            // control characters, escapes as JSON allows (no lone surrogates)
  };
  static constexpr uint32_t kUnbounded = UINT32_MAX;
  struct Element {
    Op op = Op::End;
    uint32_t arg = 0;
    uint32_t min = 0, max = 0;  // Op::String
  };
  std::vector<Element> elements;             // every alternative, each ended by End
  std::vector<std::vector<uint32_t>> rules;  // rule -> first element of each alternative
  std::vector<std::string> rule_names;
  std::vector<std::bitset<256>> byte_sets;
  uint32_t root = 0;
  // Per element: the fewest bytes that finish its alternative from there
  // (itself included; a String counts its min characters and the quote).
  // kUnbounded where no finite way exists.
  std::vector<uint32_t> min_rest;
  uint32_t min_length(uint32_t rule) const;  // of the rule's shortest sentence

  // The grammar in a GBNF-like notation, one rule a line (tests, debugging).
  std::string to_string() const;
};

// Builds a Grammar; rules may be referenced before they are defined
// (recursive schemas).
class GrammarBuilder {
 public:
  using Seq = std::vector<Grammar::Element>;
  uint32_t new_rule(std::string name);
  void add_alternative(uint32_t rule, const Seq& seq);  // an empty seq matches nothing (epsilon)
  Grammar::Element bytes(const std::bitset<256>& set);
  Grammar::Element byte(uint8_t b);
  Grammar::Element byte_range(uint8_t lo, uint8_t hi);
  static Grammar::Element ref(uint32_t rule) { return {Grammar::Op::Ref, rule, 0, 0}; }
  static Grammar::Element string_body(uint32_t min, uint32_t max) { return {Grammar::Op::String, 0, min, max}; }
  void append_literal(Seq& seq, std::string_view text);  // one Bytes element per byte
  Grammar finish(uint32_t root);

 private:
  Grammar g_;
  std::vector<std::vector<Seq>> alts_;
};

// One parse in progress: the element each level will match next, innermost
// last. Only a String frame uses the other fields (characters so far, and
// where inside an escape or a UTF-8 sequence it is).
struct GrammarFrame {
  uint32_t pos = 0;
  uint32_t count = 0;
  uint8_t sub = 0, need = 0, lo = 0, hi = 0;
  bool operator==(const GrammarFrame&) const = default;
};

// A set of stacks, stored flat. An empty stack means the input so far is a
// complete sentence of the grammar.
class GrammarStacks {
 public:
  static constexpr size_t kMaxStacks = 1024;
  size_t size() const { return ends_.size(); }
  bool empty() const { return ends_.empty(); }
  std::span<const GrammarFrame> stack(size_t i) const {
    const size_t b = i ? ends_[i - 1] : 0;
    return {frames_.data() + b, ends_[i] - b};
  }
  void clear() {
    frames_.clear();
    ends_.clear();
  }
  void add(std::span<const GrammarFrame> s);  // ignores a stack already present
  bool accepting() const;                     // some parse is complete
  bool can_continue() const;                  // some parse can take more bytes
  // The fewest bytes that complete the input (0: complete now).
  uint32_t min_bytes_to_accept(const Grammar& g) const;
  static uint32_t min_bytes_to_accept(const Grammar& g, std::span<const GrammarFrame> stack);
  // The stacks as bytes: equal keys, equal futures (the mask cache's key).
  void append_key(std::string& key) const;

 private:
  std::vector<GrammarFrame> frames_;
  std::vector<uint32_t> ends_;
};

// Whether `bytes` are whole characters that a JSON string holds as they are
// (valid UTF-8, no quote, backslash or control character); `chars` counts
// them. Such bytes inside a string's body are allowed or not by the count
// alone, whatever the grammar around the string.
bool plain_string_chars(std::string_view bytes, uint32_t& chars);

class GrammarMatcher {
 public:
  explicit GrammarMatcher(const Grammar& g);  // at the start of the root rule

  // The stacks that remain after byte b (`out` is overwritten; empty: b is
  // not allowed here).
  static void step(const Grammar& g, const GrammarStacks& in, uint8_t b, GrammarStacks& out);

  // Advances over all of `bytes`; false (and no change) if any is refused.
  bool feed(std::string_view bytes);
  bool accepting() const { return stacks_.accepting(); }
  bool can_continue() const { return stacks_.can_continue(); }
  const GrammarStacks& stacks() const { return stacks_; }
  const Grammar& grammar() const { return *g_; }

 private:
  const Grammar* g_;
  GrammarStacks stacks_, scratch_;
};

}  // namespace flashmoe
