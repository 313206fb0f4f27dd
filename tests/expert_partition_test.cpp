// The expert-parallel split (experts/expert_partition.h): each expected
// owner below is worked out by hand from the greedy rule (largest load
// first, to the least-loaded rank; ties: fewer experts, then lower rank).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "experts/expert_partition.h"

namespace flashmoe::expert_partition_test {
namespace {

TEST(ExpertPartition, OneRankOwnsEveryExpert) {
  const std::vector<int> o = partition_experts({3, 1, 4, 1, 5}, 1);
  EXPECT_EQ(o, std::vector<int>(5, 0));
}

TEST(ExpertPartition, EqualLoadsGoRoundRobin) {
  // Equal loads: ids in order, each to the rank with the fewest so far.
  EXPECT_EQ(partition_experts_evenly(8, 2), (std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(partition_experts_evenly(7, 3), (std::vector<int>{0, 1, 2, 0, 1, 2, 0}));
}

TEST(ExpertPartition, HandWorkedUnequalLoads) {
  // Loads 5,4,3,3,2,1 (ids 0..5) on 2 ranks: 5->r0 (5), 4->r1 (4), 3(id2)->r1 (7),
  // 3(id3)->r0 (8), 2->r1 (9), 1->r0 (9): 9 and 9.
  const std::vector<double> load = {5, 4, 3, 3, 2, 1};
  const std::vector<int> o = partition_experts(load, 2);
  EXPECT_EQ(o, (std::vector<int>{0, 1, 1, 0, 1, 0}));
  EXPECT_EQ(rank_loads(load, o, 2), (std::vector<double>{9, 9}));
  // The same loads in another order give the same sums (the rule sorts by load).
  const std::vector<double> shuffled = {1, 3, 5, 2, 4, 3};
  EXPECT_EQ(rank_loads(shuffled, partition_experts(shuffled, 2), 2), (std::vector<double>{9, 9}));
}

TEST(ExpertPartition, EveryExpertOnceBalancedAndDeterministic) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int E : {8, 64, 256, 512})
    for (int ranks : {1, 2, 3, 4, 8}) {
      std::vector<double> load(static_cast<size_t>(E));
      for (double& l : load) l = u(rng) * u(rng);  // skewed, as routing counts are
      const std::vector<int> o = partition_experts(load, ranks);
      ASSERT_EQ(o.size(), size_t(E));
      for (int r : o) ASSERT_TRUE(r >= 0 && r < ranks);
      EXPECT_EQ(o, partition_experts(load, ranks)) << "not deterministic";
      const std::vector<double> s = rank_loads(load, o, ranks);
      const double total = std::accumulate(load.begin(), load.end(), 0.0);
      EXPECT_NEAR(std::accumulate(s.begin(), s.end(), 0.0), total, 1e-9 * total) << "an expert lost or counted twice";
      const double largest = *std::max_element(load.begin(), load.end());
      for (double x : s) EXPECT_LE(x, total / ranks + largest + 1e-12) << "E=" << E << " ranks=" << ranks;
      // Equal loads: counts within one of each other.
      const std::vector<int> even = partition_experts_evenly(E, ranks);
      std::vector<int> count(size_t(ranks), 0);
      for (int r : even) ++count[size_t(r)];
      EXPECT_LE(*std::max_element(count.begin(), count.end()) - *std::min_element(count.begin(), count.end()), 1);
    }
}

TEST(ExpertPartition, RefusesWhatCannotBeSplit) {
  EXPECT_THROW(partition_experts({1, 1}, 0), Error);
  EXPECT_THROW(partition_experts({1, 1}, 3), Error);
  EXPECT_THROW(partition_experts({1, -1}, 2), Error);
  EXPECT_THROW(partition_experts({1, std::numeric_limits<double>::quiet_NaN()}, 2), Error);
  try {
    partition_experts({1, 1}, 3);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 GPUs for 2 experts"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flashmoe::expert_partition_test
