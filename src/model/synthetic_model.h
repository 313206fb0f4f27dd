// A model of a published size with random weights, built in host memory
// (no checkpoint): what `flashmoe bench --synthetic` runs on the CPU, a
// memory-bound decode of the real layer shapes when the model is larger than
// the last-level cache.
#pragma once
#include <cstdint>
#include <memory>

#include "core/matrix.h"
#include "core/thread_pool.h"
#include "format/config.h"
#include "model/qwen_model.h"

namespace flashmoe {

// Weights of config `c` drawn uniformly from +-1/sqrt(fan-in) in bf16 (the
// routed experts as random q8/q4 codes in groups of `group`, or FP8 blocks
// of 128 x 128, when `experts` says so; with fp8_weights every linear
// weight an FP8 release converts is FP8 blocks, experts included: embedding,
// lm_head, router and shared-expert gate stay bf16); norms at their identity. The embedding is tied to the lm_head:
// decode reads one row of it, and untied it would double the largest tensor.
// mtp_head: also a random MTP head (bench --mtp).
std::unique_ptr<QwenModel> synthetic_cpu_model(const ModelConfig& c, QuantKind experts, int group, uint64_t seed,
                                               ThreadPool& pool, bool fp8_weights = false, bool mtp_head = false);

}  // namespace flashmoe
