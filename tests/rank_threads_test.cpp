// run_on_ranks (backend/cuda/rank_threads.h): every rank runs, at once
// (each waits for all the others to have started: would hang if run one
// after another), rank 0 on the caller's thread, and the first error by
// rank comes back once all are done.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/rank_threads.h"

namespace flashmoe::rank_threads_test {
namespace {

TEST(RankThreads, AllRanksRunAtOnceRankZeroOnTheCaller) {
  constexpr int kRanks = 4;
  std::atomic<int> started{0};
  std::vector<int> ran(kRanks, 0);
  std::thread::id rank0;
  run_on_ranks(kRanks, [&](int r) {
    ++started;
    while (started.load() < kRanks) std::this_thread::yield();  // a rendezvous, as a collective is
    ran[size_t(r)] = 1;
    if (r == 0) rank0 = std::this_thread::get_id();
  });
  EXPECT_EQ(ran, std::vector<int>(kRanks, 1));
  EXPECT_EQ(rank0, std::this_thread::get_id());
}

TEST(RankThreads, TheFirstErrorByRankComesBackAfterAllFinish) {
  std::atomic<int> finished{0};
  try {
    run_on_ranks(3, [&](int r) {
      ++finished;
      if (r >= 1) throw std::runtime_error("rank " + std::to_string(r));
    });
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 1");
  }
  EXPECT_EQ(finished.load(), 3);
}

}  // namespace
}  // namespace flashmoe::rank_threads_test
