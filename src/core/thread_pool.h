// A fixed pool of worker threads for data-parallel loops. The calling thread
// takes part in every loop, so a pool of N threads uses N cores in total.
// Decoding one token issues dozens of small loops, so workers spin briefly
// between loops (microsecond wake-up) before sleeping. A spinning thread
// yields the core only when the pool has more threads than the machine has
// cores (there it may hold the core the awaited thread needs); on a machine
// shared with other programs a yield would hand the core away for a whole
// time slice while the loop it waits for is microseconds from done.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
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

  // Calls fn(i, i + 1) for every i in [0, n), one item per claim: for a few
  // items of very different cost, given most expensive first, so that the
  // threads finish together (longest-processing-time-first scheduling).
  void parallel_for_items(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

  static int hardware_threads();

 private:
  // One loop: chunks are claimed with an atomic counter, so whichever thread
  // is running takes the next chunk and a late-waking worker finds none left.
  struct Job {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, chunk, chunks;
    std::atomic<int64_t> next{0}, done{0};
    void run(ThreadPool& pool);
  };
  void worker_loop();
  void run_job(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::shared_ptr<Job> current_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace flashmoe
