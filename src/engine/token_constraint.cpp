#include "engine/token_constraint.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "engine/json_schema_grammar.h"

namespace flashmoe {

// ---- the vocabulary ----

namespace {

std::vector<std::string> trie_pieces(const Tokenizer& tok) {
  std::vector<std::string> pieces(tok.vocab_size());
  for (size_t id = 0; id < pieces.size(); ++id)
    if (!tok.is_special(int32_t(id))) pieces[id] = tok.token_to_piece(int32_t(id));
  return pieces;
}

// Sorted, a token comes right after the tokens it extends or equals, so one
// path of open nodes builds the trie in preorder.
void build(ByteTrie& t, const std::vector<std::string>& pieces, std::vector<int32_t> which) {
  std::sort(which.begin(), which.end(), [&](int32_t a, int32_t b) {
    return pieces[size_t(a)] != pieces[size_t(b)] ? pieces[size_t(a)] < pieces[size_t(b)] : a < b;
  });
  std::vector<uint32_t> path;
  const std::string* prev = nullptr;
  for (int32_t id : which) {
    const std::string& p = pieces[size_t(id)];
    size_t lcp = 0;
    if (prev) {
      const size_t n = std::min(prev->size(), p.size());
      while (lcp < n && (*prev)[lcp] == p[lcp]) ++lcp;
    }
    while (path.size() > lcp) {
      t.nodes[path.back()].subtree_end = uint32_t(t.nodes.size());
      path.pop_back();
    }
    for (size_t d = path.size(); d < p.size(); ++d) {
      path.push_back(uint32_t(t.nodes.size()));
      t.nodes.push_back({0, uint32_t(t.ids.size()), uint32_t(t.ids.size()), uint16_t(d + 1), uint8_t(p[d])});
    }
    ByteTrie::Node& n = t.nodes[path.back()];
    if (n.tokens_begin == n.tokens_end) n.tokens_begin = n.tokens_end = uint32_t(t.ids.size());
    t.ids.push_back(id);
    n.tokens_end = uint32_t(t.ids.size());
    t.max_depth = std::max(t.max_depth, p.size());
    prev = &p;
  }
  while (!path.empty()) {
    t.nodes[path.back()].subtree_end = uint32_t(t.nodes.size());
    path.pop_back();
  }
}

void set_bits(std::vector<uint64_t>& bits, std::span<const int32_t> ids) {
  for (int32_t id : ids) bits[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
}

}  // namespace

TokenVocabulary::TokenVocabulary(const Tokenizer& tok) : TokenVocabulary(trie_pieces(tok)) {}

TokenVocabulary::TokenVocabulary(std::vector<std::string> pieces) : pieces_(std::move(pieces)) {
  std::vector<int32_t> every, other;
  for (size_t id = 0; id < pieces_.size(); ++id) {
    std::string& p = pieces_[id];
    if (p.size() > std::numeric_limits<uint16_t>::max()) p.clear();
    if (p.empty()) continue;
    every.push_back(int32_t(id));
    uint32_t chars = 0;
    if (plain_string_chars(p, chars)) plain_.push_back({int32_t(id), chars});
    else other.push_back(int32_t(id));
  }
  build(all_, pieces_, std::move(every));
  build(not_plain_, pieces_, std::move(other));
  std::stable_sort(plain_.begin(), plain_.end(), [](const Plain& a, const Plain& b) { return a.chars < b.chars; });
}

// ---- the constraint ----

GrammarConstraint::GrammarConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> trie)
    : grammar_(std::move(grammar)), trie_(std::move(trie)), matcher_(*grammar_) {
  level_.resize(trie_->all().max_depth + 1);
}

template <class OnTokens>
void GrammarConstraint::walk(const ByteTrie& trie, const GrammarStacks& start, OnTokens&& on_tokens) {
  if (start.empty()) return;
  const auto& nodes = trie.nodes;
  level_[0] = start;
  // Preorder: when a node is reached, level_[depth - 1] still holds the
  // stacks after its parent's bytes.
  for (size_t i = 0; i < nodes.size();) {
    const ByteTrie::Node& n = nodes[i];
    GrammarStacks& here = level_[n.depth];
    GrammarMatcher::step(*grammar_, level_[n.depth - 1u], n.byte, here);
    if (here.empty()) {
      i = n.subtree_end;  // no token with this prefix can follow
      continue;
    }
    if (n.tokens_end > n.tokens_begin) on_tokens(trie.tokens(n), here);
    ++i;
  }
}

void GrammarConstraint::split() {
  in_string_.clear();
  other_.clear();
  const GrammarStacks& all = matcher_.stacks();
  for (size_t i = 0; i < all.size(); ++i) {
    auto s = all.stack(i);
    const bool body = !s.empty() && grammar_->elements[s.back().pos].op == Grammar::Op::String && s.back().sub == 0;
    (body ? in_string_ : other_).add(s);
  }
}

const std::vector<uint64_t>& GrammarConstraint::allowed() {
  key_.clear();
  matcher_.stacks().append_key(key_);
  if (auto it = cache_.find(key_); it != cache_.end()) {
    ++hits_;
    current_ = it->second;
    return *current_;
  }
  ++walks_;
  auto bits = std::make_shared<std::vector<uint64_t>>((trie_->vocab_size() + 63) / 64, 0);
  split();
  walk(trie_->all(), other_, [&](std::span<const int32_t> ids, const GrammarStacks&) { set_bits(*bits, ids); });
  if (!in_string_.empty()) {
    walk(trie_->not_plain(), in_string_, [&](std::span<const int32_t> ids, const GrammarStacks&) { set_bits(*bits, ids); });
    uint32_t room = 0;  // the most characters a string on top may still take
    for (size_t i = 0; i < in_string_.size(); ++i) {
      const GrammarFrame& f = in_string_.stack(i).back();
      room = std::max(room, grammar_->elements[f.pos].max - f.count);
    }
    for (const TokenVocabulary::Plain& p : trie_->plain()) {
      if (p.chars > room) break;
      (*bits)[size_t(p.id) >> 6] |= uint64_t(1) << (p.id & 63);
    }
  }
  // The cache holds at most ~32 MB of masks; states rarely repeat once it is
  // that full, so it simply starts over.
  const size_t max_entries = std::max<size_t>(16, (size_t(32) << 20) / (bits->size() * 8 + 1));
  if (cache_.size() >= max_entries) cache_.clear();
  cache_.emplace(key_, bits);
  current_ = std::move(bits);
  return *current_;
}

const std::vector<uint64_t>& GrammarConstraint::allowed_within(int64_t budget) {
  const uint64_t limit = budget > 1 ? uint64_t(budget - 1) : 0;  // bytes the later tokens can still add
  const uint32_t now = bytes_to_complete();
  within_.assign((trie_->vocab_size() + 63) / 64, 0);
  closer_.assign(within_.size(), 0);
  bool any_within = false;
  auto judge = [&](std::span<const int32_t> ids, uint32_t after) {
    for (int32_t id : ids) {
      const uint64_t bit = uint64_t(1) << (id & 63);
      if (after <= limit) within_[size_t(id) >> 6] |= bit, any_within = true;
      if (after < now) closer_[size_t(id) >> 6] |= bit;
    }
  };
  auto by_stacks = [&](std::span<const int32_t> ids, const GrammarStacks& here) {
    judge(ids, here.min_bytes_to_accept(*grammar_));
  };
  split();
  walk(trie_->all(), other_, by_stacks);
  if (!in_string_.empty()) {
    walk(trie_->not_plain(), in_string_, by_stacks);
    // A plain token of k characters in a string with room for them: the
    // string still needs max(0, need - k) characters, nothing else changes.
    struct Body {
      uint32_t room, need, rest;
    };
    std::vector<Body> bodies;
    for (size_t i = 0; i < in_string_.size(); ++i) {
      auto s = in_string_.stack(i);
      const Grammar::Element& e = grammar_->elements[s.back().pos];
      const uint32_t need = e.min > s.back().count ? e.min - s.back().count : 0;
      bodies.push_back({e.max - s.back().count, need, GrammarStacks::min_bytes_to_accept(*grammar_, s) - need});
    }
    for (const TokenVocabulary::Plain& p : trie_->plain()) {
      uint32_t after = Grammar::kUnbounded;
      for (const Body& b : bodies)
        if (p.chars <= b.room) after = std::min(after, b.rest + (b.need > p.chars ? b.need - p.chars : 0));
      if (after != Grammar::kUnbounded) judge({&p.id, 1}, after);
    }
  }
  return any_within ? within_ : closer_;
}

bool GrammarConstraint::mask(std::span<float> logits, std::span<const int32_t> eos_ids, int64_t budget) {
  const bool tight = budget > 0 && int64_t(bytes_to_complete()) + kBudgetSlack >= budget;
  const std::vector<uint64_t>& bits = tight ? allowed_within(budget) : allowed();
  const bool done = complete();
  const size_t known = std::min(logits.size(), trie_->vocab_size());
  bool any = false;
  // Ids past the tokenizer's vocabulary (padding rows of the output layer)
  // are never allowed.
  std::vector<std::pair<int32_t, float>> keep;
  if (done)
    for (int32_t e : eos_ids)
      if (e >= 0 && size_t(e) < logits.size()) keep.emplace_back(e, logits[size_t(e)]);
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < known; ++i) {
    if ((bits[i >> 6] >> (i & 63)) & 1) any = true;
    else logits[i] = kOff;
  }
  for (size_t i = known; i < logits.size(); ++i) logits[i] = kOff;
  for (const auto& [id, l] : keep) logits[size_t(id)] = l;
  if (!any && !done) fail("structured output: no token of the vocabulary can continue the output");
  return any || !keep.empty();
}

void GrammarConstraint::accept(int32_t id) {
  if (id < 0 || size_t(id) >= trie_->vocab_size() || trie_->bytes(id).empty() || !matcher_.feed(trie_->bytes(id)))
    fail("structured output: token " + std::to_string(id) + " does not continue the output allowed");
}

// ---- response_format ----

std::unique_ptr<TokenConstraint> make_json_constraint(const nlohmann::ordered_json& rf,
                                                      std::shared_ptr<const TokenVocabulary> trie) {
  auto bad = [](const std::string& msg) { throw JsonSchemaError(msg); };
  if (!rf.is_object()) bad("'response_format' must be an object");
  auto type = rf.find("type");
  if (type == rf.end() || !type->is_string())
    bad("'response_format.type' must be one of text, json_object, json_schema");
  const std::string t = type->get<std::string>();
  for (const auto& [k, v] : rf.items())
    if (k != "type" && !(k == "json_schema" && t == "json_schema"))
      bad("'response_format." + k + "' is not supported with type '" + t + "'");
  std::shared_ptr<const Grammar> g;
  if (t == "text") return nullptr;
  if (t == "json_object") {
    g = std::make_shared<const Grammar>(json_object_grammar());
  } else if (t == "json_schema") {
    auto js = rf.find("json_schema");
    if (js == rf.end() || !js->is_object()) bad("'response_format.json_schema' must be an object");
    for (const auto& [k, v] : js->items()) {
      if (k == "name" || k == "description") {
        if (!v.is_string()) bad("'response_format.json_schema." + k + "' must be a string");
      } else if (k == "strict") {
        if (!v.is_boolean() && !v.is_null()) bad("'response_format.json_schema.strict' must be a boolean");
      } else if (k != "schema") {
        bad("'response_format.json_schema." + k + "' is not supported");
      }
    }
    auto schema = js->find("schema");
    if (schema == js->end()) bad("'response_format.json_schema.schema' is required");
    g = std::make_shared<const Grammar>(json_schema_grammar(*schema));
  } else {
    bad("'response_format.type' must be one of text, json_object, json_schema (got '" + t + "')");
  }
  try {
    return std::make_unique<GrammarConstraint>(std::move(g), std::move(trie));
  } catch (const JsonSchemaError&) {
    throw;
  } catch (const Error& e) {  // the matcher's backstop against a rule that loops
    throw JsonSchemaError(std::string("response_format schema: ") + e.what());
  }
}

}  // namespace flashmoe
