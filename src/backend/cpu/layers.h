// The per-layer pieces of the CPU forward pass (backend/cpu/forward.cpp walks
// the plan and calls them), each over one step's stacked activations: the
// rows of every sequence in the step, one after another (x, out: [rows, H];
// x is the normed residual stream, out the layer's update). Products run
// over all rows at once, so each weight is read once per step; the token
// mixers run their recurrences per sequence, on that sequence's own state.
#pragma once
#include <vector>

#include "core/thread_pool.h"
#include "experts/expert_store.h"
#include "format/config.h"
#include "kv/kv_cache.h"
#include "model/model_state.h"
#include "model/weights.h"

namespace flashmoe::cpu {

// Rows per claim of the CPU layers' per-row loops (norms, residual adds, the
// projections' split, the q/k norms): a row is a few hundred multiply-adds,
// so fewer than this many stay on the calling thread.
inline constexpr int64_t kRowGrain = 16;

// One sequence's rows [row0, row0 + n) in a step: its tokens at positions
// state->pos, state->pos + 1, ... (the walk advances pos after the last layer).
struct SequenceRows {
  ModelState* state = nullptr;
  int64_t row0 = 0, n = 0;
};

// MixerKind::GatedAttention (attention_mixer.cpp): q/k RMSNorm, partial NeoX
// RoPE, GQA softmax attention over each sequence's KV cache `slot` (its
// keys appended first), sigmoid output gate, o_proj.
void gated_attention_mixer(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq, int slot,
                           const std::vector<SequenceRows>& seqs, const float* x, int64_t rows, float* out,
                           ThreadPool& pool);
// The same for one sequence's n rows through `cache` from position pos0 (the
// MTP head's own cache).
void gated_attention_mixer(const ModelConfig& c, const AttentionWeights& w, const float* rope_inv_freq,
                           KvCache& cache, int64_t pos0, const float* x, int64_t n, float* out, ThreadPool& pool);

// MixerKind::GatedDeltaNet (delta_net_mixer.cpp): causal conv + SiLU, the
// delta-rule recurrence over each sequence's states `slot`, gated RMSNorm,
// out_proj.
void gated_delta_net_mixer(const ModelConfig& c, const LinearAttentionWeights& w, int slot,
                           const std::vector<SequenceRows>& seqs, const float* x, int64_t rows, float* out,
                           ThreadPool& pool);

// FfnKind::DenseSwiGLU (ffn.cpp): down(silu(gate x) * up x).
void dense_swiglu_ffn(const FfnExpert& e, const float* x, int64_t n, float* out, ThreadPool& pool);

// FfnKind::RoutedMoE (ffn.cpp): softmax router, top-k experts of model layer
// `layer` fetched from `store` (one fetch for the union over all rows),
// plus the sigmoid-gated shared expert when `shared_expert`.
void routed_moe_ffn(const ModelConfig& c, const FfnWeights& w, bool shared_expert, ExpertStore& store,
                    int64_t layer, const float* x, int64_t n, float* out, ThreadPool& pool);

}  // namespace flashmoe::cpu
