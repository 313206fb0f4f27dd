// How many bytes of weights one decoded token reads: everything outside the
// routed experts, plus top-k experts per MoE layer, plus one embedding row.
// The denominator of "achieved memory bandwidth" for a memory-bound decode.
#pragma once
#include <cstdint>

#include "model/weights.h"

namespace flashmoe {

struct WeightBytes {
  int64_t total = 0;           // every weight of the text model
  int64_t experts_total = 0;   // all routed experts
  int64_t per_token = 0;       // read per decoded token
};

WeightBytes count_weight_bytes(const ModelConfig& cfg, const ModelWeights& w);

}  // namespace flashmoe
