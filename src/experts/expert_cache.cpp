#include "experts/expert_cache.h"

namespace flashmoe {

std::shared_ptr<const void> ExpertCache::get(uint64_t key) {
  ++uses_[key];
  auto it = map_.find(key);
  if (it == map_.end()) return nullptr;
  recency_.splice(recency_.begin(), recency_, it->second.pos);
  return it->second.buf;
}

void ExpertCache::evict_one() {
  auto victim = std::prev(recency_.end());  // LRU: the oldest
  if (policy_ == CachePolicy::Lfu) {
    // Least used; scanning from the oldest makes recency the tie-break.
    uint64_t best = UINT64_MAX;
    for (auto it = std::prev(recency_.end());; --it) {
      uint64_t u = uses_[*it];
      if (u < best) best = u, victim = it;
      if (it == recency_.begin()) break;
    }
  }
  auto m = map_.find(*victim);
  bytes_ -= m->second.bytes;
  map_.erase(m);
  recency_.erase(victim);
}

void ExpertCache::put(uint64_t key, std::shared_ptr<const void> buf, uint64_t bytes) {
  if (bytes > capacity_ || map_.count(key)) return;
  while (bytes_ + bytes > capacity_ && !map_.empty()) evict_one();
  recency_.push_front(key);
  map_.emplace(key, Entry{std::move(buf), bytes, recency_.begin()});
  bytes_ += bytes;
}

}  // namespace flashmoe
