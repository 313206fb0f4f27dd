// --max-memory: what the process needs besides the expert cache, and how big
// the cache may then be. A configuration that cannot fit is refused up front
// with the breakdown, rather than discovered as an OOM kill mid-generation.
#pragma once
#include <cstdint>
#include <string>

#include "experts/expert_store.h"
#include "format/config.h"

namespace flashmoe {

struct MemoryPlan {
  uint64_t non_expert = 0;   // weights besides the routed experts (mmapped, resident once touched)
  uint64_t state = 0;        // recurrent state + a KV reserve
  uint64_t runtime = 0;      // activations, logits, threads, allocator slack
  uint64_t working_set = 0;  // experts pinned while one layer runs (the minimum cache)
  uint64_t cache = 0;        // the streaming cache's capacity
};

// Positions of KV reserved in the budget (f32); longer contexts need more.
constexpr int64_t kBudgetKvPositions = 4096;

// Plans for a streaming store. `expert_bytes` is one expert's in-memory
// footprint, `all_experts` the bytes of every expert in the model.
MemoryPlan plan_streaming_memory(const ModelConfig& cfg, uint64_t non_expert, uint64_t expert_bytes,
                                 uint64_t all_experts, const ExpertOptions& opt);
// Checks an in-memory store (all weights resident) against --max-memory.
void check_in_memory_fits(const ModelConfig& cfg, uint64_t all_weights, const ExpertOptions& opt);

std::string mib(uint64_t bytes);  // "123.4 MiB"

}  // namespace flashmoe
