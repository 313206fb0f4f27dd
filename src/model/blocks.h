// The three per-layer blocks, each over a chunk of n consecutive tokens
// (x, out: [n, H]). Internal to model/.
#pragma once
#include "core/thread_pool.h"
#include "format/config.h"
#include "experts/expert_store.h"
#include "kv/kv_cache.h"
#include "model/weights.h"

namespace flashmoe {

void attention_block(const ModelConfig& c, const AttentionWeights& w, const float* inv_freq,
                     KvCache& cache, int64_t pos0, const float* x, int64_t n, float* out,
                     ThreadPool& pool);

void linear_attention_block(const ModelConfig& c, const LinearAttentionWeights& w,
                            std::vector<float>& conv_state, std::vector<float>& ssm_state,
                            const float* x, int64_t n, float* out, ThreadPool& pool);

// Routed experts of MoE layer `layer` come from `store`.
void ffn_block(const ModelConfig& c, const FfnWeights& w, ExpertStore& store, int64_t layer, const float* x,
               int64_t n, float* out, ThreadPool& pool);

}  // namespace flashmoe
