// The weights of a Qwen3.5 / Qwen3-Next text model as views into the
// checkpoint, each checked against config.json when loaded. Small vectors
// (norms, gates' biases, conv taps) are widened to fp32 once.
#pragma once
#include <memory>
#include <vector>

#include "core/matrix.h"
#include "experts/ffn_expert.h"
#include "format/checkpoint.h"
#include "format/config.h"

namespace flashmoe {

struct AttentionWeights {
  Matrix q_proj;  // [2*nh*hd, H]: per head [query | gate]
  Matrix k_proj, v_proj, o_proj;
  std::vector<float> q_norm, k_norm;  // [hd]
};

struct LinearAttentionWeights {
  // Qwen3.5: separate projections. Qwen3-Next: qkvz / ba grouped per key head.
  bool grouped = false;
  Matrix in_qkv, in_z, in_b, in_a;
  Matrix in_qkvz, in_ba;
  std::vector<float> conv;      // [conv_dim, K]
  std::vector<float> dt_bias;   // [nv]
  std::vector<float> neg_exp_A; // -exp(A_log), [nv]
  std::vector<float> norm;      // [dv]
  Matrix out_proj;              // [H, nv*dv]
};

struct FfnWeights {
  bool moe = false;
  Matrix router;                  // [E, H]
  std::vector<FfnExpert> experts; // [E], HF checkpoints only; the forward pass asks the ExpertStore
  bool has_shared = false;
  FfnExpert shared;
  Matrix shared_gate;             // [1, H]
  FfnExpert dense;                // non-MoE layers
};

struct LayerWeights {
  LayerKind kind = LayerKind::Linear;
  std::vector<float> input_norm, post_norm;
  AttentionWeights attn;
  LinearAttentionWeights lin;
  FfnWeights ffn;
};

struct ModelWeights {
  Matrix embed;    // [V, H]
  Matrix lm_head;  // [V, H] (the embedding when tied)
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
};

// With with_experts false (packed models) the routed experts are left to the
// expert store and FfnWeights::experts stays empty.
ModelWeights load_weights(const Checkpoint& ck, const ModelConfig& cfg, bool with_experts = true);

}  // namespace flashmoe
