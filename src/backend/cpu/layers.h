// The per-layer pieces of the CPU forward pass (backend/cpu/forward.cpp walks
// the plan and calls them), each over a chunk of n consecutive tokens
// (x, out: [n, H]; x is the normed residual stream, out the layer's update).
#pragma once
#include <vector>

#include "core/thread_pool.h"
#include "experts/expert_store.h"
#include "format/config.h"
#include "kv/kv_cache.h"
#include "model/weights.h"

namespace flashmoe::cpu {

// MixerKind::GatedAttention (attention_mixer.cpp): q/k RMSNorm, partial NeoX
// RoPE at positions pos0.., GQA softmax attention over `cache` (the chunk's
// keys appended first), sigmoid output gate, o_proj.
void gated_attention_mixer(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq,
                           KvCache& cache, int64_t pos0, const float* x, int64_t n, float* out, ThreadPool& pool);

// MixerKind::GatedDeltaNet (delta_net_mixer.cpp): causal conv + SiLU, the
// delta-rule recurrence over `ssm_state`, gated RMSNorm, out_proj.
void gated_delta_net_mixer(const ModelConfig& c, const LinearAttentionWeights& w, std::vector<float>& conv_state,
                           std::vector<float>& ssm_state, const float* x, int64_t n, float* out, ThreadPool& pool);

// FfnKind::DenseSwiGLU (ffn.cpp): down(silu(gate x) * up x).
void dense_swiglu_ffn(const FfnExpert& e, const float* x, int64_t n, float* out, ThreadPool& pool);

// FfnKind::RoutedMoE (ffn.cpp): softmax router, top-k experts of model layer
// `layer` fetched from `store`, plus the sigmoid-gated shared expert when
// `shared_expert`.
void routed_moe_ffn(const ModelConfig& c, const FfnWeights& w, bool shared_expert, ExpertStore& store,
                    int64_t layer, const float* x, int64_t n, float* out, ThreadPool& pool);

}  // namespace flashmoe::cpu
