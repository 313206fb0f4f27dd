// What every family's plan shares; the plans themselves are in model/arch/.
#include "model/plan.h"

#include <string>

#include "core/error.h"

namespace flashmoe {

void check_token_ids(const ModelConfig& c, const int32_t* ids, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab_size)
      fail("token id " + std::to_string(ids[i]) + " is out of range: the vocabulary has " +
           std::to_string(c.vocab_size) + " tokens (0.." + std::to_string(c.vocab_size - 1) + ")");
}

}  // namespace flashmoe
