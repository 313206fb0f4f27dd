#include "server/state_cache.h"

#include <algorithm>

namespace flashmoe::server {

std::shared_ptr<const Snapshot> StateCache::find(const std::vector<int32_t>& prompt) {
  std::lock_guard<std::mutex> lock(mu_);
  auto best = lru_.end();
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    const auto& t = (*it)->tokens;
    if (t.empty() || t.size() >= prompt.size()) continue;
    if (best != lru_.end() && t.size() <= (*best)->tokens.size()) continue;
    if (std::equal(t.begin(), t.end(), prompt.begin())) best = it;
  }
  if (best == lru_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, best);
  return lru_.front();
}

void StateCache::put(Snapshot snap) {
  if (snap.tokens.empty() || !would_keep(snap.bytes())) return;
  insert(std::make_shared<Snapshot>(std::move(snap)));
}

void StateCache::insert(std::shared_ptr<Snapshot> snap) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = lru_.begin(); it != lru_.end();) {
    if ((*it)->tokens == snap->tokens) {
      bytes_ -= (*it)->bytes();
      it = lru_.erase(it);
    } else {
      ++it;
    }
  }
  bytes_ += snap->bytes();
  lru_.push_front(std::move(snap));
  while (lru_.size() > capacity_ || bytes_ > max_bytes_) {
    bytes_ -= lru_.back()->bytes();
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
