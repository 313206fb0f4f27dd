#include "experts/expert_partition.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "core/error.h"

namespace flashmoe {

std::vector<int> partition_experts(const std::vector<double>& load, int ranks) {
  const int64_t E = int64_t(load.size());
  if (ranks < 1) fail("expert partition: " + std::to_string(ranks) + " GPUs (expected at least 1)");
  if (ranks > E && E > 0)
    fail("expert partition: " + std::to_string(ranks) + " GPUs for " + std::to_string(E) +
         " experts per layer (each GPU needs at least one expert)");
  for (int64_t e = 0; e < E; ++e)
    if (!std::isfinite(load[size_t(e)]) || load[size_t(e)] < 0)
      fail("expert partition: expert " + std::to_string(e) + " has load " + std::to_string(load[size_t(e)]) +
           " (expected a finite value >= 0)");
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return load[size_t(a)] > load[size_t(b)]; });
  std::vector<double> sum(size_t(ranks), 0.0);
  std::vector<int64_t> count(size_t(ranks), 0);
  std::vector<int> owner(size_t(E), 0);
  for (const int64_t e : order) {
    int best = 0;
    for (int r = 1; r < ranks; ++r) {
      const size_t i = size_t(r), b = size_t(best);
      if (sum[i] < sum[b] || (sum[i] == sum[b] && count[i] < count[b])) best = r;
    }
    owner[size_t(e)] = best;
    sum[size_t(best)] += load[size_t(e)];
    ++count[size_t(best)];
  }
  return owner;
}

std::vector<int> partition_experts_evenly(int64_t experts, int ranks) {
  return partition_experts(std::vector<double>(size_t(std::max<int64_t>(experts, 0)), 1.0), ranks);
}

std::vector<double> rank_loads(const std::vector<double>& load, const std::vector<int>& owner, int ranks) {
  std::vector<double> s(size_t(std::max(ranks, 0)), 0.0);
  for (size_t e = 0; e < owner.size() && e < load.size(); ++e)
    if (owner[e] >= 0 && owner[e] < ranks) s[size_t(owner[e])] += load[e];
  return s;
}

}  // namespace flashmoe
