#include "experts/memory_budget.h"

#include <algorithm>
#include <cstdio>
#include <unistd.h>

#include "core/error.h"

namespace flashmoe {

namespace {

constexpr uint64_t kMiB = 1ull << 20;

uint64_t state_bytes(const ModelConfig& c) {
  const uint64_t rec = uint64_t(c.num_linear_layers()) *
                       (c.lin_num_v_heads * c.lin_k_dim * c.lin_v_dim + c.lin_conv_dim() * (c.conv_kernel - 1)) * 4;
  const uint64_t kv = uint64_t(c.num_full_layers()) * 2 * c.num_kv_heads * c.head_dim * 4 * kBudgetKvPositions;
  return rec + kv;
}

// A prefill chunk's activations and logits plus a fixed allowance for the
// binary, libraries, thread stacks and allocator slack (a streamed coder-mini
// run peaks ~5 MiB above its non-expert weights plus cache; see docs/streaming.md).
uint64_t runtime_bytes(const ModelConfig& c) { return 256ull * (c.vocab_size + 16 * c.hidden_size) * 4 + 16 * kMiB; }

uint64_t budget_bytes(const ExpertOptions& o) { return uint64_t(o.max_memory_gb * double(1ull << 30)); }

}  // namespace

std::string mib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(kMiB));
  return buf;
}

MemoryPlan plan_streaming_memory(const ModelConfig& c, uint64_t non_expert, uint64_t expert_bytes,
                                 uint64_t all_experts, const ExpertOptions& o) {
  MemoryPlan p;
  p.non_expert = non_expert;
  p.state = state_bytes(c);
  p.runtime = runtime_bytes(c);
  // One layer of a 256-token prefill chunk can route to every expert at once.
  p.working_set = uint64_t(std::min<int64_t>(c.num_experts, 256 * c.num_experts_per_tok)) * expert_bytes;
  const uint64_t requested = o.cache_mb < 0 ? all_experts : uint64_t(o.cache_mb) * kMiB;
  if (o.max_memory_gb <= 0) {
    // No budget given: an automatic cache still stays within 3/4 of physical
    // memory, so a model larger than RAM never grows its cache into swap/OOM.
    const uint64_t phys = uint64_t(::sysconf(_SC_PHYS_PAGES)) * uint64_t(::sysconf(_SC_PAGESIZE));
    const uint64_t fixed = p.non_expert + p.state + p.runtime + p.working_set;
    const uint64_t room = phys / 4 * 3 > fixed ? phys / 4 * 3 - fixed : 0;
    p.cache = o.cache_mb < 0 ? std::min(requested, room) : requested;
    return p;
  }
  const uint64_t budget = budget_bytes(o);
  const uint64_t fixed = p.non_expert + p.state + p.runtime + p.working_set;
  const std::string breakdown = "non-expert weights " + mib(p.non_expert) + " + state " + mib(p.state) +
                                " (KV reserve of " + std::to_string(kBudgetKvPositions) + " positions) + runtime " +
                                mib(p.runtime) + " + minimum expert working set " + mib(p.working_set) + " = " + mib(fixed);
  if (fixed > budget)
    fail("--max-memory " + mib(budget) + " cannot fit this model: it needs at least " + breakdown);
  const uint64_t room = budget - fixed;
  if (o.cache_mb >= 0 && requested > room)
    fail("--expert-cache " + std::to_string(o.cache_mb) + " MiB does not fit in --max-memory " + mib(budget) +
         ": only " + mib(room) + " is left after " + breakdown);
  p.cache = std::min(requested, room);
  return p;
}

void check_in_memory_fits(const ModelConfig& c, uint64_t all_weights, const ExpertOptions& o) {
  if (o.max_memory_gb <= 0) return;
  const uint64_t need = all_weights + state_bytes(c) + runtime_bytes(c);
  if (need > budget_bytes(o))
    fail("--max-memory " + mib(budget_bytes(o)) + " cannot hold this model in memory (weights " + mib(all_weights) +
         " + state and runtime " + mib(need - all_weights) +
         "); pack it (flashmoe pack) and run the packed directory to stream its experts");
}

}  // namespace flashmoe
