// The text-model hyper-parameters of a Qwen3.5 / Qwen3-Next config.json,
// normalised over the four model types (multimodal wrapper or flat).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace flashmoe {

enum class Family { Qwen35, Qwen3Next };
enum class LayerKind { Linear, Full };

struct ModelConfig {
  std::string model_type;       // as written in config.json
  Family family = Family::Qwen35;
  bool multimodal_wrapper = false;

  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0;
  float rms_norm_eps = 1e-6f;
  std::vector<LayerKind> layer_kinds;

  // Full (gated) attention.
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rope_theta = 1e7;
  double partial_rotary_factor = 0.25;
  int64_t rotary_dim = 0;  // head_dim * partial_rotary_factor, even

  // GatedDeltaNet.
  int64_t lin_num_k_heads = 0, lin_num_v_heads = 0, lin_k_dim = 0, lin_v_dim = 0;
  int64_t conv_kernel = 4;

  // Feed-forward: MoE layers and/or dense SwiGLU layers.
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate = 0;
  int64_t shared_intermediate = 0;  // 0: no shared expert
  int64_t intermediate_size = 0;    // dense MLP layers
  bool norm_topk_prob = true;
  std::vector<bool> layer_is_moe;

  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  std::vector<int64_t> eos_token_ids;
  // The dtype the checkpoint declares ("bfloat16", "float16", "float32"; empty
  // if absent). HF keeps the RoPE inverse frequencies in this dtype.
  std::string torch_dtype;

  int64_t num_full_layers() const;
  int64_t num_linear_layers() const;
  int64_t lin_conv_dim() const { return 2 * lin_num_k_heads * lin_k_dim + lin_num_v_heads * lin_v_dim; }
};

// Parses config.json text; `source` names the file in error messages.
ModelConfig parse_model_config(const std::string& json_text, const std::string& source);
// Reads DIR/config.json (or a config.json path).
ModelConfig load_model_config(const std::string& dir_or_file);

// --moe-top-k K: route each token to its K most probable experts instead of
// the num_experts_per_tok the model was trained with, by lowering that field,
// which every router reads (the kept weights are renormalised over the K when
// the model renormalises its own top-k). Throws Error naming the option when
// K < 1, K exceeds the model's value, or the model has no routed experts.
void limit_experts_per_token(ModelConfig* c, int64_t k);

}  // namespace flashmoe
