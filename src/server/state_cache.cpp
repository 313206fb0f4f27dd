#include "server/state_cache.h"

#include <algorithm>

namespace flashmoe::server {

std::shared_ptr<const Snapshot> StateCache::find(const std::vector<int32_t>& prompt, const std::string& partition) {
  std::lock_guard<std::mutex> lock(mu_);
  auto best = lru_.end();
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    if (it->partition != partition) continue;
    const auto& t = it->snap->tokens;
    if (t.empty() || t.size() >= prompt.size()) continue;
    if (best != lru_.end() && t.size() <= best->snap->tokens.size()) continue;
    if (std::equal(t.begin(), t.end(), prompt.begin())) best = it;
  }
  if (best == lru_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, best);
  return lru_.front().snap;
}

void StateCache::put(Snapshot snap, const std::string& partition) {
  if (snap.tokens.empty() || !would_keep(snap.bytes())) return;
  insert({partition, std::make_shared<Snapshot>(std::move(snap))});
}

void StateCache::insert(Entry e) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = lru_.begin(); it != lru_.end();) {
    if (it->partition == e.partition && it->snap->tokens == e.snap->tokens) {
      bytes_ -= it->snap->bytes();
      it = lru_.erase(it);
    } else {
      ++it;
    }
  }
  bytes_ += e.snap->bytes();
  lru_.push_front(std::move(e));
  while (lru_.size() > capacity_ || bytes_ > max_bytes_) {
    bytes_ -= lru_.back().snap->bytes();
    lru_.pop_back();
  }
}

size_t StateCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

size_t StateCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace flashmoe::server
