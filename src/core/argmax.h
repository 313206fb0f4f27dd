// The index of the largest of n values, the lowest index among equal ones
// (greedy decoding on the host; the GPU's argmax kernel picks the same).
#pragma once
#include <cstdint>

namespace flashmoe {

inline int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

}  // namespace flashmoe
