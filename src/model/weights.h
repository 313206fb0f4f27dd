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

// A projection whose output rows come from one or more stored matrices in
// another order. Checkpoints lay the same projection out differently (Qwen3.5
// stores in_proj_qkv / _z / _b / _a; Qwen3-Next groups qkvz and ba per key
// head): the loader resolves the layout once into `blocks`, listed in output
// order, so the backends run one canonical layout. Products are taken over
// the stored matrices (big products stay big); the blocks say where each
// stored row lands.
struct SplitProjection {
  struct Block {
    int matrix = 0;  // index into `stored`
    int64_t row0 = 0, rows = 0;
  };
  std::vector<Matrix> stored;
  std::vector<Block> blocks;
  int64_t rows() const;
  // Every block as a view of its rows, in output order (for a backend that
  // stores the projection as one matrix of its own).
  std::vector<Matrix> block_views() const;
  // Rewrites one token's outputs of the stored matrices (outs[i] holds
  // stored[i].rows values) into the output order.
  void gather(const float* const* outs, float* y) const;
};

struct LinearAttentionWeights {
  // Output rows: q (nk*dk), k (nk*dk), v (nv*dv), z (nv*dv), b (nv), a (nv).
  SplitProjection in_proj;
  std::vector<float> conv;      // [conv_dim, K]
  std::vector<float> dt_bias;   // [nv]
  std::vector<float> neg_exp_A; // -exp(A_log), [nv]
  std::vector<float> norm;      // [dv]
  Matrix out_proj;              // [H, nv*dv]
  // Order of the value heads in v, z, b, a, A, dt_bias and out_proj's
  // columns. Grouped (HF): the r = nv/nk value heads of key head g are
  // g*r .. g*r+r-1, so value head h reads key head h / r. Tiled (llama.cpp's
  // Qwen3.5 GGUFs): value head h reads key head h % nk. Either way the
  // outputs are the same; only the pairing of value and key heads differs.
  bool v_heads_tiled = false;
  int64_t key_head(int64_t h, int64_t nk, int64_t r) const { return v_heads_tiled ? h % nk : h / r; }
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
