#include "server/state_cache.h"

#include <algorithm>

namespace flashmoe::server {

std::shared_ptr<const Snapshot> StateCache::find(const std::vector<int32_t>& prompt, const std::string& partition,
                                                  std::chrono::milliseconds wait) {
  auto extends = [&](const std::vector<int32_t>& t) {
    return !t.empty() && t.size() < prompt.size() && std::equal(t.begin(), t.end(), prompt.begin());
  };
  const auto deadline = std::chrono::steady_clock::now() + wait;
  bool may_wait = true;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto best = lru_.end();
    for (auto it = lru_.begin(); it != lru_.end(); ++it) {
      if (it->partition != partition) continue;
      if (best != lru_.end() && it->snap->tokens.size() <= best->snap->tokens.size()) continue;
      if (extends(it->snap->tokens)) best = it;
    }
    const size_t have = best == lru_.end() ? 0 : best->snap->tokens.size();
    // A store on its way that this prompt extends further: wait for it
    // (it is the conversation this request continues, most likely).
    bool better_coming = false;
    for (const Announced& a : pending_)
      better_coming = better_coming || (a.partition == partition && a.tokens.size() > have && extends(a.tokens));
    if (better_coming && may_wait) {  // then look again (entries may have come and gone meanwhile)
      if (stored_.wait_until(lock, deadline) == std::cv_status::timeout) may_wait = false;  // take what is there
      continue;
    }
    if (best == lru_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, best);
    return lru_.front().snap;
  }
}

StateCache::Pending::Pending(StateCache& c, std::vector<int32_t> tokens, std::string partition) : cache_(&c) {
  std::lock_guard<std::mutex> lock(c.mu_);
  id_ = c.next_id_++;
  c.pending_.push_back({id_, std::move(partition), std::move(tokens)});
}

void StateCache::Pending::done() {
  if (!cache_) return;
  {
    std::lock_guard<std::mutex> lock(cache_->mu_);
    cache_->pending_.remove_if([&](const Announced& a) { return a.id == id_; });
  }
  cache_->stored_.notify_all();
  cache_ = nullptr;
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
