// Model slots: --parallel N requests run at once (their forward passes
// share the batch scheduler's steps, engine/batch_scheduler.h). Further
// requests wait in a bounded queue; beyond it acquire() refuses at once so
// the caller can answer 503 instead of piling up connections.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace flashmoe::server {

class SlotPool {
 public:
  SlotPool(int slots, int queue);

  class Lease {
   public:
    Lease(SlotPool& pool, int index) : pool_(pool), index_(index) {}
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    // Publishes the KV and recurrent-state bytes held by the request's
    // state, for the gauges (measured by the request's own thread, so
    // nothing reads a state that is being written).
    void report(int64_t kv_bytes, int64_t recurrent_bytes);

   private:
    SlotPool& pool_;
    int index_;
  };

  // A free slot, waiting in the queue for one if needed; null when the queue
  // is full or the pool is shutting down.
  std::unique_ptr<Lease> acquire();
  // Wakes every waiter (they get null) and refuses new requests.
  void shutdown();

  int slots() const { return int(busy_.size()); }
  int busy() const;
  int waiting() const;
  // KV and recurrent-state bytes last reported by the running requests.
  void state_bytes(int64_t* kv, int64_t* recurrent) const;

 private:
  std::vector<bool> busy_;
  std::vector<std::pair<int64_t, int64_t>> bytes_;  // per slot: KV, recurrent
  int queue_limit_, waiting_ = 0;
  bool stopping_ = false;
  mutable std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace flashmoe::server
