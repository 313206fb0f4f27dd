#include "runtime/backend.h"

#include "core/error.h"

namespace flashmoe {

void Backend::forward_capturing(State&, const int32_t*, int64_t, LogitsMode, float*, ThreadPool&,
                                std::vector<std::vector<float>>*) const {
  fail(std::string("per-layer hidden states are only available on the CPU (this model runs on ") + label() + ")");
}

}  // namespace flashmoe
