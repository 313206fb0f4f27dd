#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace thread_pool_test {

using namespace flashmoe;

// Every item is handed out exactly once and alone, and while one thread is
// held by item 0 the other claims the remaining items.
TEST(ThreadPool, ParallelForItemsClaimsOneItemAtATime) {
  ThreadPool pool(2);
  const int64_t n = 16;
  std::vector<std::atomic<int>> calls(n);
  std::mutex mu;
  std::thread::id holder;
  bool holder_known = false;
  std::atomic<int> others{0};
  pool.parallel_for_items(n, [&](int64_t b, int64_t e) {
    ASSERT_EQ(e, b + 1);
    ++calls[size_t(b)];
    if (b == 0) {
      {
        std::lock_guard<std::mutex> lk(mu);
        holder = std::this_thread::get_id();
        holder_known = true;
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (others.load() < n - 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return;
    }
    // Wait until item 0's thread is known, then count items run elsewhere.
    for (;;) {
      std::lock_guard<std::mutex> lk(mu);
      if (holder_known) {
        if (std::this_thread::get_id() != holder) ++others;
        break;
      }
    }
  });
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(calls[size_t(i)].load(), 1) << "item " << i;
  EXPECT_EQ(others.load(), n - 1);
}

TEST(ThreadPool, ParallelForCoversTheRangeOnce) {
  ThreadPool pool(2);
  for (int64_t n : {1, 7, 100, 1000}) {
    std::vector<std::atomic<int>> calls(static_cast<size_t>(n));
    pool.parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) ++calls[size_t(i)];
    }, 3);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(calls[size_t(i)].load(), 1) << "n " << n << " item " << i;
  }
}

}  // namespace thread_pool_test
