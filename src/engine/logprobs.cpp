#include "engine/logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace flashmoe {

TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int top) {
  if (logits.empty() || id < 0 || size_t(id) >= logits.size()) fail("token_logprob: token id outside the logits");
  // log-sum-exp in double around the maximum: exact enough that a reader
  // recomputing it in float64 from the same logits gets the same value.
  const float max_l = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l) - double(max_l));
  const double lse = double(max_l) + std::log(sum);
  TokenLogprob r;
  r.id = id;
  r.logprob = float(double(logits[size_t(id)]) - lse);
  const size_t k = std::min(size_t(std::max(top, 0)), logits.size());
  if (k > 0) {
    std::vector<int32_t> idx(logits.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + std::ptrdiff_t(k), idx.end(), [&](int32_t a, int32_t b) {
      return logits[size_t(a)] != logits[size_t(b)] ? logits[size_t(a)] > logits[size_t(b)] : a < b;
    });
    for (size_t i = 0; i < k; ++i) r.top.emplace_back(idx[i], float(double(logits[size_t(idx[i])]) - lse));
  }
  return r;
}

}  // namespace flashmoe
