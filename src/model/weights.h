// The weights of a Qwen3.5 / Qwen3-Next text model as views into the
// checkpoint, each checked against config.json when loaded. Small vectors
// (norms, gates' biases, conv taps) are widened to fp32 once.
#pragma once
#include <memory>
#include <optional>
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

// The multi-token-prediction head (`mtp.*`, one layer): it predicts the
// token after next from the main model's final (normed) hidden state at t
// and the embedding of token t+1: fc([norm_e(embed(x_{t+1})) | norm_h(h_t)]),
// one full-attention decoder layer with its own KV cache and its own FFN,
// then `final_norm`; the logits come from the shared lm_head.
struct MtpWeights {
  Matrix fc;  // [H, 2H]
  std::vector<float> norm_embedding, norm_hidden, final_norm;  // [H] each, zero-centred like every norm here
  LayerWeights layer;  // kind Full; its routed experts are always in FfnWeights::experts
};

struct ModelWeights {
  Matrix embed;    // [V, H]
  Matrix lm_head;  // [V, H] (the embedding when tied)
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
  std::optional<MtpWeights> mtp;  // when the checkpoint has an MTP head
};

// With with_experts false (packed models) the routed experts are left to the
// expert store and FfnWeights::experts stays empty.
ModelWeights load_weights(const Checkpoint& ck, const ModelConfig& cfg, bool with_experts = true);

}  // namespace flashmoe
