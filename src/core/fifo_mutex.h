// A mutex that grants the lock in the order it was asked for (a ticket
// lock). std::mutex makes no such promise: a thread that unlocks and locks
// again at once, as a decode loop does once per token, can keep winning and
// starve the others. Used to share one device among the server's sessions
// so that concurrent requests take turns token by token.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace flashmoe {

class FifoMutex {
 public:
  void lock() {
    std::unique_lock<std::mutex> l(mu_);
    const uint64_t ticket = next_++;
    cv_.wait(l, [&] { return serving_ == ticket; });
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> l(mu_);
      ++serving_;
    }
    cv_.notify_all();  // the waiter holding the next ticket is among them
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ = 0, serving_ = 0;
};

}  // namespace flashmoe
