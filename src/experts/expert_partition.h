// Expert parallelism: which GPU (rank) holds each routed expert of a layer.
// Every GPU runs the whole layer sequence on the same token(s) but computes
// only the weighted outputs of the experts it holds; one all-reduce per MoE
// layer sums them (backend/cuda/multi_gpu.h, docs/multi-gpu.md). The split
// below decides how evenly the expert bytes read per token fall on the GPUs.
#pragma once
#include <cstdint>
#include <vector>

namespace flashmoe {

// Owner rank of each of load.size() experts over `ranks` GPUs, balancing the
// summed load (an expert's share of the routing choices, measured or
// assumed; all equal when unknown): longest processing time first, each
// expert in descending load (ties: lower id first) to the rank with the
// least load so far (ties: fewer experts, then the lower rank). Properties
// (tests/expert_partition_test.cpp): every expert has exactly one owner; it
// is deterministic; a rank's load exceeds the mean by at most the largest
// single load (and with equal loads the counts differ by at most one);
// with ranks == 1 every expert is rank 0's. Errors (Error) name a rank
// count below 1 or above the experts, or a negative or non-finite load.
std::vector<int> partition_experts(const std::vector<double>& load, int ranks);

// Equal loads for E experts (no measurement): expert e on rank e % ranks.
std::vector<int> partition_experts_evenly(int64_t experts, int ranks);

// The summed load of each rank under an owner vector (reports and tests).
std::vector<double> rank_loads(const std::vector<double>& load, const std::vector<int>& owner, int ranks);

}  // namespace flashmoe
