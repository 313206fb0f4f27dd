#include "kv/snapkv_select.h"

#include <algorithm>

namespace flashmoe {

std::vector<int64_t> snapkv_keep(const double* score, int64_t n, const KvConfig& cfg) {
  const int64_t B = cfg.snapkv_budget, R = cfg.snapkv_recent(), S = std::min(cfg.sinks, B - R);
  const int64_t half = KvConfig::kSnapPool / 2;
  std::vector<int64_t> cand;
  for (int64_t s = S; s < n - R; ++s) cand.push_back(s);
  std::vector<double> pooled(size_t(n), 0.0);
  for (int64_t s : cand) {
    double m = 0;
    for (int64_t u = std::max<int64_t>(0, s - half); u <= std::min(n - 1, s + half); ++u) m = std::max(m, score[u]);
    pooled[size_t(s)] = m;
  }
  const int64_t take = B - R - S;
  // Highest pooled score first; ties (a pool spreads one peak over its 7
  // neighbours): the higher own score, then the newer.
  std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), [&](int64_t a, int64_t b) {
    if (pooled[size_t(a)] != pooled[size_t(b)]) return pooled[size_t(a)] > pooled[size_t(b)];
    if (score[a] != score[b]) return score[a] > score[b];
    return a > b;
  });
  std::vector<int64_t> keep;
  for (int64_t s = 0; s < S; ++s) keep.push_back(s);
  std::vector<int64_t> chosen(cand.begin(), cand.begin() + take);
  std::sort(chosen.begin(), chosen.end());
  keep.insert(keep.end(), chosen.begin(), chosen.end());
  for (int64_t s = n - R; s < n; ++s) keep.push_back(s);
  return keep;
}

}  // namespace flashmoe
