// SnapKV's choice (--kv-snapkv B), shared by the CPU's KvCache and the CUDA
// backend, so that both keep the same positions from the same scores.
#pragma once
#include <cstdint>
#include <vector>

#include "kv/kv_config.h"

namespace flashmoe {

// The n prompt slots to keep (ascending, B = cfg.snapkv_budget of them; n > B):
// the first S = min(sinks, B - R), the last R = cfg.snapkv_recent(), and of
// the others the B - S - R with the highest score max-pooled over
// kSnapPool neighbours (clipped at the ends); ties: the higher own score,
// then the newer. score[s]: the attention slot s got from the prompt's last
// observed queries, summed over them and all heads.
std::vector<int64_t> snapkv_keep(const double* score, int64_t n, const KvConfig& cfg);

}  // namespace flashmoe
