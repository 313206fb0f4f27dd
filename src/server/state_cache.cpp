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

void StateCache::put(std::vector<int32_t> tokens, const ModelState& state) {
  if (capacity_ == 0 || tokens.empty()) return;
  // Copy outside the lock: a state copy can be large.
  auto snap = std::make_shared<Snapshot>(Snapshot{std::move(tokens), state});
  std::lock_guard<std::mutex> lock(mu_);
  lru_.remove_if([&](const std::shared_ptr<const Snapshot>& s) { return s->tokens == snap->tokens; });
  lru_.push_front(std::move(snap));
  while (lru_.size() > capacity_) lru_.pop_back();
}

size_t StateCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

size_t StateCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : lru_) n += s->bytes();
  return n;
}

}  // namespace flashmoe::server
