#include "tokenizer/bpe.h"

#include <queue>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/json_ids.h"

namespace flashmoe {

void BpeModel::load(const nlohmann::json& model) {
  const auto& vocab = model.at("vocab");
  if (!vocab.is_object()) fail("tokenizer.json: model.vocab is not an object");
  int32_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    max_id = std::max(max_id, json_token_id(it.value(), "model.vocab[\"" + it.key() + "\"]"));
  id_bytes_.assign(size_t(max_id + 1), {});
  id_tokens_.assign(size_t(max_id + 1), {});
  bytes_to_id_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int32_t id = json_token_id(it.value(), "model.vocab");
    std::string bytes = byte_level::decode_token(it.key());
    id_tokens_[id] = it.key();
    bytes_to_id_[bytes] = id;
    id_bytes_[id] = std::move(bytes);
  }
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, char(b));
    auto it = bytes_to_id_.find(one);
    if (it == bytes_to_id_.end()) fail("tokenizer.json: byte-level vocab lacks byte " + std::to_string(b));
    byte_id_[b] = it->second;
  }

  // nlohmann's object lookups are ordered-map finds; a hash index of the
  // vocab spellings makes resolving ~150k merges several times cheaper.
  std::unordered_map<std::string_view, int32_t> spelling;
  spelling.reserve(id_tokens_.size());
  for (size_t id = 0; id < id_tokens_.size(); ++id)
    if (!id_tokens_[id].empty()) spelling.emplace(id_tokens_[id], int32_t(id));
  std::string joined;

  // Merges come either as "a b" strings (older files) or as [a, b] pairs.
  const auto& merges = model.at("merges");
  merges_.reserve(merges.size());
  int32_t rank = 0;
  for (const auto& m : merges) {
    std::string_view a, b;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail("tokenizer.json: bad merge #" + std::to_string(rank + 1) + ": \"" + s + "\"");
      a = std::string_view(s).substr(0, sp);
      b = std::string_view(s).substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get_ref<const std::string&>();
      b = m[1].get_ref<const std::string&>();
    } else {
      fail("tokenizer.json: bad merge #" + std::to_string(rank + 1));
    }
    joined = a;
    joined += b;
    auto ia = spelling.find(a), ib = spelling.find(b), iab = spelling.find(joined);
    if (ia == spelling.end() || ib == spelling.end() || iab == spelling.end())
      fail("tokenizer.json: merge #" + std::to_string(rank + 1) + " uses a token not in the vocab");
    // A repeated pair keeps the later rank, as HF's HashMap collect does.
    merges_[pair_key(ia->second, ib->second)] = {rank, iab->second};
    ++rank;
  }
  ignore_merges_ = model.value("ignore_merges", false);
}

int32_t BpeModel::id_of_bytes(std::string_view bytes) const {
  auto it = bytes_to_id_.find(bytes);
  return it == bytes_to_id_.end() ? -1 : it->second;
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (word.size() == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(word[0])]);
    return;
  }
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mu_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard lock(cache_mu_);
    if (cache_.size() >= kCacheMaxEntries) cache_.clear();
    cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + long(start), out.end()));
  }
}

// HF's Word::merge_all: a min-heap of candidate merges ordered by (rank,
// position); stale candidates (a side already merged away) are skipped when
// popped. This is the classic "lowest rank first, leftmost on ties" BPE, in
// O(n log n) so long runs (whitespace, minified code) stay cheap.
void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    if (int32_t id = id_of_bytes(word); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const int32_t n = int32_t(word.size());
  std::vector<Sym> syms(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    syms[i] = {byte_id_[static_cast<unsigned char>(word[i])], i - 1, i + 1 < n ? i + 1 : -1, true};

  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> queue;
  auto push_pair = [&](int32_t left) {
    const int32_t right = syms[left].next;
    if (right < 0) return;
    auto it = merges_.find(pair_key(syms[left].id, syms[right].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);

  while (!queue.empty()) {
    const Cand c = queue.top();
    queue.pop();
    Sym& left = syms[c.pos];
    if (!left.alive || left.next < 0) continue;
    Sym& right = syms[left.next];
    auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.new_id != c.new_id) continue;
    left.id = c.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = c.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

}  // namespace flashmoe
