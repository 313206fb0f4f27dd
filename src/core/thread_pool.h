// A fixed pool of worker threads for data-parallel loops. The calling thread
// takes part in every loop, so a pool of N threads uses N cores in total.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace flashmoe {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // threads <= 0: all hardware threads
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(begin, end) over [0, n) split into contiguous chunks of at least
  // `grain` items; returns when all are done. Not reentrant.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                    int64_t grain = 1);

  static int hardware_threads();

 private:
  void worker_loop(int index);
  void run_chunks();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, chunk_ = 0, next_ = 0;
  uint64_t generation_ = 0;
  int busy_ = 0;
  bool stop_ = false;
};

}  // namespace flashmoe
