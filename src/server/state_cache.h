// Conversation snapshots for reuse across requests. Hybrid models cannot
// rewind a GatedDeltaNet state, so a plain prefix cache over KV entries does
// not work: instead we keep whole state copies (Session::snapshot) taken at message
// boundaries, each with the exact token ids it has consumed. A request whose
// prompt ids extend a snapshot's ids starts from a copy of that snapshot and
// feeds only the suffix. The pool is bounded (LRU) by entry count and by
// bytes: a long conversation's KV cache can be large on a real model.
// Entries live in partitions (one per API key and cache_salt): a request
// only ever starts from a snapshot of its own partition, so one client's
// stored conversation never serves, or shows up in the cached_tokens of,
// another's.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/session.h"

namespace flashmoe::server {

using Snapshot = SessionSnapshot;

class StateCache {
 public:
  explicit StateCache(size_t capacity, size_t max_bytes = SIZE_MAX) : capacity_(capacity), max_bytes_(max_bytes) {}

  // The snapshot with the longest token list that is a proper prefix of
  // `prompt` (at least one prompt token is left to feed, so the caller gets
  // fresh logits), or null. A hit becomes the most recently used entry.
  // A store announced (Pending) with a longer such token list is waited for
  // first, up to `wait`: a follow-up sent the moment an answer ended finds
  // that answer's conversation although its copy was still being taken.
  std::shared_ptr<const Snapshot> find(const std::vector<int32_t>& prompt, const std::string& partition = "",
                                       std::chrono::milliseconds wait = std::chrono::seconds(5));

  // A store announced before it happens: a streamed answer writes its last
  // events first and stores its conversation after (a copy of a large
  // model's state to host memory takes tens of milliseconds, which the
  // client need not wait for). Until done() or destruction, find() waits for it where it
  // would be the better match.
  class Pending {
   public:
    Pending() = default;
    Pending(StateCache& c, std::vector<int32_t> tokens, std::string partition);
    ~Pending() { done(); }
    Pending(const Pending&) = delete;
    Pending& operator=(const Pending&) = delete;
    void done();  // the store happened, or will not

   private:
    StateCache* cache_ = nullptr;
    uint64_t id_ = 0;
  };

  // Whether a snapshot of about `bytes` would be kept at all (capacity 0, or
  // larger than the whole budget: no), so that callers skip the copy.
  bool would_keep(size_t bytes) const { return capacity_ > 0 && bytes <= max_bytes_; }
  // Stores a snapshot (an entry with the same tokens is replaced); evicts the
  // least recently used entries beyond the capacity or the byte budget. No-op
  // when would_keep says no, or for an empty token list.
  void put(Snapshot snap, const std::string& partition = "");

  size_t capacity() const { return capacity_; }
  size_t size() const;
  size_t bytes() const;  // memory held by all snapshots

 private:
  struct Entry {
    std::string partition;
    std::shared_ptr<const Snapshot> snap;
  };
  struct Announced {
    uint64_t id;
    std::string partition;
    std::vector<int32_t> tokens;
  };
  void insert(Entry e);
  size_t capacity_, max_bytes_, bytes_ = 0;
  mutable std::mutex mu_;
  std::condition_variable stored_;  // a Pending ended
  std::list<Entry> lru_;  // front = most recent
  std::list<Announced> pending_;
  uint64_t next_id_ = 1;
};

}  // namespace flashmoe::server
