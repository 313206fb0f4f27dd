#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() {}
#endif

namespace flashmoe {

namespace {
// How long an idle thread spins before sleeping: long enough to bridge the
// gap between two loops of one decode step, short enough not to burn a core
// while the program waits for input.
constexpr auto kSpin = std::chrono::microseconds(100);

// Spins until pred() holds or the spin budget is spent; returns pred().
// `yield`: give the core away between polls. Only when the pool has more
// threads than the machine has: there a spinning thread may hold the core
// the awaited one needs. Otherwise a yield on a machine shared with other
// programs hands the core to one of them for a whole time slice
// (milliseconds) while the awaited loop is microseconds from done.
template <class Pred>
bool spin_until(Pred pred, bool yield) {
  auto until = std::chrono::steady_clock::now() + kSpin;
  for (int i = 1;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if (i % 64 == 0) {
      if (yield) std::this_thread::yield();
      if (std::chrono::steady_clock::now() > until) return pred();
    }
  }
}

// More threads in the pool than the machine has.
bool oversubscribed(int threads) {
  static const int hardware = ThreadPool::hardware_threads();
  return threads > hardware;
}
}  // namespace

int ThreadPool::hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(n);
}

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = hardware_threads();
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Job::run(ThreadPool& pool) {
  for (;;) {
    int64_t c = next.fetch_add(1, std::memory_order_relaxed);
    if (c >= chunks) return;
    int64_t b = c * chunk;
    (*fn)(b, std::min(n, b + chunk));
    if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
      std::lock_guard<std::mutex> lk(pool.mu_);
      pool.done_cv_.notify_all();
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    auto changed = [&] { return stop_.load(std::memory_order_relaxed) || generation_.load(std::memory_order_acquire) != seen; };
    if (!spin_until(changed, oversubscribed(size()))) {
      std::unique_lock<std::mutex> lk(mu_);
      wake_cv_.wait(lk, changed);
    }
    if (stop_.load()) return;
    std::shared_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job = current_;
      seen = generation_.load();
    }
    if (job) job->run(*this);
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
  // A few chunks per thread balances uneven work without much contention.
  const int64_t chunks = std::min<int64_t>(int64_t(size()) * 4, (n + grain - 1) / grain);
  run_job(n, (n + chunks - 1) / chunks, fn);
}

void ThreadPool::parallel_for_items(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  run_job(n, 1, fn);
}

void ThreadPool::run_job(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  job->chunk = chunk;
  job->chunks = (n + chunk - 1) / chunk;
  {
    std::lock_guard<std::mutex> lk(mu_);
    current_ = job;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  job->run(*this);
  auto finished = [&] { return job->done.load(std::memory_order_acquire) == job->chunks; };
  if (!spin_until(finished, oversubscribed(size()))) {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, finished);
  }
}

}  // namespace flashmoe
