// The model as a list of layers, decided once from config.json: each layer
// is a token mixer followed by a feed-forward. The CPU forward pass, the
// CUDA decode step and the CUDA prefill all walk this list, so the layer
// sequence of a family is written in one place (model/arch/*).
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "format/config.h"

namespace flashmoe {

// What mixes information across positions.
enum class MixerKind {
  GatedAttention,  // full softmax attention with an output gate, q/k norms, partial RoPE; keeps a KV cache
  GatedDeltaNet,   // linear attention: causal conv + delta-rule recurrence; keeps a conv and a matrix state
};

// What transforms each position on its own.
enum class FfnKind {
  DenseSwiGLU,  // one SwiGLU MLP (intermediate_size)
  RoutedMoE,    // top-k routed SwiGLU experts, with a gated shared expert when LayerPlan::shared_expert
};

struct LayerPlan {
  int index = 0;  // position in the model
  MixerKind mixer = MixerKind::GatedDeltaNet;
  // Index among the layers with the same mixer: the KV cache of an
  // attention layer, the conv/recurrent state of a GatedDeltaNet layer.
  int state_slot = 0;
  FfnKind ffn = FfnKind::DenseSwiGLU;
  bool shared_expert = false;  // RoutedMoE only
  int moe_slot = -1;           // index among the RoutedMoE layers, -1 for dense ones
};

struct ModelPlan {
  std::vector<LayerPlan> layers;
  int attention_layers = 0, delta_layers = 0, moe_layers = 0;
  // RoPE inverse frequencies [rotary_dim / 2], rounded to the checkpoint's
  // dtype the way HF keeps its inv_freq buffer (it shifts logits by ~1e-3).
  std::vector<float> rope_inv_freq;
  // The multi-token-prediction head's decoder layer (index num_layers), when
  // the checkpoint has one: GatedAttention with a KV cache of its own
  // (ModelState::mtp_kv, state_slot 0) and its FFN; moe_slot 0 names its
  // experts in QwenModel::mtp_expert_store(), not in the main store.
  std::optional<LayerPlan> mtp;
};

// The plan of a Qwen3.5 / Qwen3-Next config (model/arch/qwen35.cpp).
ModelPlan make_plan(const ModelConfig& c);
// The plan of a Qwen3.5 / Qwen3-Next MTP layer (its FFN is routed when the
// checkpoint has a router for it: `moe`).
LayerPlan make_mtp_layer_plan(const ModelConfig& c, bool moe);

// Throws Error naming the first id outside [0, vocab_size): every backend
// checks a forward pass's ids with this before touching any state.
void check_token_ids(const ModelConfig& c, const int32_t* ids, int64_t n);

}  // namespace flashmoe
