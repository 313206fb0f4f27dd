// A bounded cache of expert buffers keyed by (layer, expert). LRU evicts the
// least recently used; LFU evicts the least often used over the whole run
// (counts survive eviction, so an expert the router keeps coming back to
// wins its place back), ties broken by recency. Buffers are shared_ptrs: an
// evicted buffer still in use by the forward pass lives until released.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>

#include "experts/expert_store.h"

namespace flashmoe {

class ExpertCache {
 public:
  ExpertCache(uint64_t capacity_bytes, CachePolicy policy) : capacity_(capacity_bytes), policy_(policy) {}

  static uint64_t key(int64_t layer, int32_t expert) { return (uint64_t(layer) << 32) | uint32_t(expert); }

  // The cached buffer or null; counts a use either way.
  std::shared_ptr<const void> get(uint64_t key);
  // Inserts, evicting until it fits; a buffer larger than the capacity is not kept.
  void put(uint64_t key, std::shared_ptr<const void> buf, uint64_t bytes);

  uint64_t bytes() const { return bytes_; }
  uint64_t capacity() const { return capacity_; }
  size_t size() const { return map_.size(); }

 private:
  struct Entry {
    std::shared_ptr<const void> buf;
    uint64_t bytes;
    std::list<uint64_t>::iterator pos;  // in recency_, most recent at the front
  };
  void evict_one();

  uint64_t capacity_, bytes_ = 0;
  CachePolicy policy_;
  std::list<uint64_t> recency_;
  std::unordered_map<uint64_t, Entry> map_;
  std::unordered_map<uint64_t, uint64_t> uses_;  // LFU counts, kept across evictions
};

}  // namespace flashmoe
