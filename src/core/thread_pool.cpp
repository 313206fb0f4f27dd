#include "core/thread_pool.h"

#include <algorithm>

namespace flashmoe {

int ThreadPool::hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(n);
}

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = hardware_threads();
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunks() {
  for (;;) {
    int64_t b;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (next_ >= n_) return;
      b = next_;
      next_ += chunk_;
    }
    (*job_)(b, std::min(n_, b + chunk_));
  }
}

void ThreadPool::worker_loop(int) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      start_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_chunks();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--busy_ == 0) done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (workers_.empty() || n <= grain) {
    fn(0, n);
    return;
  }
  // A few chunks per thread balances uneven work without much locking.
  int64_t chunks = std::min<int64_t>(int64_t(size()) * 4, (n + grain - 1) / grain);
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    n_ = n;
    chunk_ = (n + chunks - 1) / chunks;
    next_ = 0;
    busy_ = int(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  run_chunks();
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return busy_ == 0; });
  job_ = nullptr;
}

}  // namespace flashmoe
