#include "engine/token_constraint.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "engine/json_schema_grammar.h"

namespace flashmoe {

// ---- the vocabulary trie ----

namespace {
std::vector<std::string> trie_pieces(const Tokenizer& tok) {
  std::vector<std::string> pieces(tok.vocab_size());
  for (size_t id = 0; id < pieces.size(); ++id)
    if (!tok.is_special(int32_t(id))) pieces[id] = tok.token_to_piece(int32_t(id));
  return pieces;
}
}  // namespace

TokenTrie::TokenTrie(const Tokenizer& tok) : TokenTrie(trie_pieces(tok)) {}

TokenTrie::TokenTrie(std::vector<std::string> pieces) : pieces_(std::move(pieces)), vocab_size_(pieces_.size()) {
  std::vector<int32_t> order;
  for (size_t id = 0; id < vocab_size_; ++id) {
    std::string& p = pieces_[id];
    if (p.size() > std::numeric_limits<uint16_t>::max()) p.clear();
    if (!p.empty()) order.push_back(int32_t(id));
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return pieces_[size_t(a)] != pieces_[size_t(b)] ? pieces_[size_t(a)] < pieces_[size_t(b)] : a < b;
  });
  // Sorted, a token comes right after the tokens it extends or equals, so
  // one path of open nodes builds the trie in preorder.
  std::vector<uint32_t> path;
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& p = pieces_[size_t(id)];
    size_t lcp = 0;
    if (prev) {
      const size_t n = std::min(prev->size(), p.size());
      while (lcp < n && (*prev)[lcp] == p[lcp]) ++lcp;
    }
    while (path.size() > lcp) {
      nodes_[path.back()].subtree_end = uint32_t(nodes_.size());
      path.pop_back();
    }
    for (size_t d = path.size(); d < p.size(); ++d) {
      path.push_back(uint32_t(nodes_.size()));
      nodes_.push_back(Node{0, uint32_t(ids_.size()), uint32_t(ids_.size()), uint16_t(d + 1), uint8_t(p[d])});
    }
    Node& n = nodes_[path.back()];
    if (n.tokens_begin == n.tokens_end) n.tokens_begin = n.tokens_end = uint32_t(ids_.size());
    ids_.push_back(id);
    n.tokens_end = uint32_t(ids_.size());
    max_depth_ = std::max(max_depth_, p.size());
    prev = &p;
  }
  while (!path.empty()) {
    nodes_[path.back()].subtree_end = uint32_t(nodes_.size());
    path.pop_back();
  }
}

// ---- the constraint ----

GrammarConstraint::GrammarConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTrie> trie)
    : grammar_(std::move(grammar)), trie_(std::move(trie)), matcher_(*grammar_) {
  level_.resize(trie_->max_depth() + 1);
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
  const auto& nodes = trie_->nodes();
  level_[0] = matcher_.stacks();
  // Preorder: when a node is reached, level_[depth - 1] still holds the
  // stacks after its parent's bytes.
  for (size_t i = 0; i < nodes.size();) {
    const TokenTrie::Node& n = nodes[i];
    GrammarStacks& here = level_[n.depth];
    GrammarMatcher::step(*grammar_, level_[n.depth - 1u], n.byte, here);
    if (here.empty()) {
      i = n.subtree_end;  // no token with this prefix can follow
      continue;
    }
    for (int32_t id : trie_->tokens(n)) (*bits)[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
    ++i;
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
  const auto& nodes = trie_->nodes();
  level_[0] = matcher_.stacks();
  for (size_t i = 0; i < nodes.size();) {
    const TokenTrie::Node& n = nodes[i];
    GrammarStacks& here = level_[n.depth];
    GrammarMatcher::step(*grammar_, level_[n.depth - 1u], n.byte, here);
    if (here.empty()) {
      i = n.subtree_end;
      continue;
    }
    if (n.tokens_end > n.tokens_begin) {
      const uint32_t after = here.min_bytes_to_accept(*grammar_);
      for (int32_t id : trie_->tokens(n)) {
        const uint64_t bit = uint64_t(1) << (id & 63);
        if (after <= limit) within_[size_t(id) >> 6] |= bit, any_within = true;
        if (after < now) closer_[size_t(id) >> 6] |= bit;
      }
    }
    ++i;
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
                                                      std::shared_ptr<const TokenTrie> trie) {
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
