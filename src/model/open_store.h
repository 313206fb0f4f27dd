// Picks and builds the expert store for a model directory: in memory for a
// plain HF checkpoint (the experts in `w`, which must outlive the store),
// streaming (or mmapped, on request) for a packed one.
#pragma once
#include <memory>
#include <string>

#include "experts/expert_store.h"
#include "experts/memory_budget.h"
#include "format/checkpoint.h"
#include "format/config.h"
#include "format/gguf.h"
#include "model/weights.h"

namespace flashmoe {

std::unique_ptr<ExpertStore> open_expert_store(const std::string& dir, const ModelConfig& cfg, const Checkpoint& ck,
                                               const ModelWeights& w, const ExpertOptions& opt);

// The routed experts of a GGUF model, served in memory from the mmapped
// file in their stored type.
std::unique_ptr<ExpertStore> open_gguf_expert_store(const GgufModel& g, const ModelConfig& cfg, const ModelWeights& w,
                                                    const ExpertOptions& opt);

}  // namespace flashmoe
