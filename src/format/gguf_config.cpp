#include "format/gguf_config.h"

#include <cmath>

#include "core/error.h"

namespace flashmoe {

ModelConfig gguf_model_config(const GgufModel& g) {
  const std::string& src = g.path();
  const std::string arch = g.get_string("general.architecture");
  ModelConfig c;
  if (arch == "qwen35moe") c.model_type = "qwen3_5_moe_text";
  else if (arch == "qwen35") c.model_type = "qwen3_5_text";
  else if (arch == "qwen3next") c.model_type = "qwen3_next";
  else
    fail(src + ": GGUF architecture '" + arch + "' is not supported (flashmoe runs qwen35moe, qwen35, qwen3next)");
  c.family = arch == "qwen3next" ? Family::Qwen3Next : Family::Qwen35;
  const std::string a = arch + ".";
  auto pos = [&](const std::string& key) {
    const int64_t v = g.get_int(a + key);
    if (v <= 0) fail(src + ": GGUF metadata '" + a + key + "' must be positive (got " + std::to_string(v) + ")");
    return v;
  };

  // block_count includes the multi-token-prediction layers appended after
  // the trunk (Qwen3.5's nextn layers), which flashmoe does not run.
  const int64_t nextn = g.get_int(a + "nextn_predict_layers", 0);
  c.num_layers = pos("block_count") - nextn;
  if (nextn < 0 || c.num_layers <= 0) fail(src + ": " + a + "nextn_predict_layers leaves no layers");
  c.hidden_size = pos("embedding_length");
  c.rms_norm_eps = float(g.get_float(a + "attention.layer_norm_rms_epsilon", 1e-6));
  c.num_heads = pos("attention.head_count");
  c.num_kv_heads = g.has(a + "attention.head_count_kv") ? pos("attention.head_count_kv") : c.num_heads;
  c.head_dim = g.has(a + "attention.key_length") ? pos("attention.key_length") : c.hidden_size / c.num_heads;
  if (c.num_heads % c.num_kv_heads != 0)
    fail(src + ": attention.head_count (" + std::to_string(c.num_heads) + ") must be a multiple of head_count_kv (" +
         std::to_string(c.num_kv_heads) + ")");
  c.rope_theta = g.get_float(a + "rope.freq_base", 1e4);
  c.rotary_dim = g.has(a + "rope.dimension_count") ? pos("rope.dimension_count") : c.head_dim;
  if (c.rotary_dim > c.head_dim || c.rotary_dim % 2)
    fail(src + ": rope.dimension_count " + std::to_string(c.rotary_dim) + " is invalid for head size " +
         std::to_string(c.head_dim));
  c.partial_rotary_factor = double(c.rotary_dim) / double(c.head_dim);

  // GatedDeltaNet: group_count = key heads, time_step_rank = value heads,
  // state_size = key head size, inner_size = value heads * value head size.
  c.lin_num_k_heads = pos("ssm.group_count");
  c.lin_num_v_heads = pos("ssm.time_step_rank");
  c.lin_k_dim = pos("ssm.state_size");
  const int64_t inner = pos("ssm.inner_size");
  if (inner % c.lin_num_v_heads != 0 || c.lin_num_v_heads % c.lin_num_k_heads != 0)
    fail(src + ": ssm.inner_size / ssm.time_step_rank / ssm.group_count do not divide evenly");
  c.lin_v_dim = inner / c.lin_num_v_heads;
  c.conv_kernel = pos("ssm.conv_kernel");

  // Layer kinds: attention.recurrent_layers (one flag per layer) when given,
  // else every full_attention_interval-th layer is full attention.
  if (const GgufValue* rl = g.find(a + "attention.recurrent_layers")) {
    if (rl->type != GgufValueType::Array || int64_t(rl->ints.size()) < c.num_layers)
      fail(src + ": " + a + "attention.recurrent_layers must list a flag per layer");
    for (int64_t i = 0; i < c.num_layers; ++i) c.layer_kinds.push_back(rl->ints[size_t(i)] ? LayerKind::Linear : LayerKind::Full);
  } else {
    const int64_t interval = g.get_int(a + "full_attention_interval", 4);
    if (interval <= 0) fail(src + ": " + a + "full_attention_interval must be positive");
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layer_kinds.push_back((i + 1) % interval == 0 ? LayerKind::Full : LayerKind::Linear);
  }

  const GgufTensor* embd = g.tensor("token_embd.weight");
  if (!embd || embd->ne.size() != 2) fail(src + ": GGUF has no 2-D tensor 'token_embd.weight'");
  c.vocab_size = embd->ne[1];

  // Feed-forward: a layer with a router (ffn_gate_inp) is MoE, else dense.
  c.intermediate_size = g.get_int(a + "feed_forward_length", 0);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool moe = arch != "qwen35" && g.has_tensor("blk." + std::to_string(i) + ".ffn_gate_inp.weight");
    c.layer_is_moe.push_back(moe);
    if (!moe && c.intermediate_size <= 0)
      fail(src + ": layer " + std::to_string(i) + " has no router (ffn_gate_inp) and " + a +
           "feed_forward_length is missing");
  }
  bool any_moe = false;
  for (bool m : c.layer_is_moe) any_moe = any_moe || m;
  if (any_moe) {
    c.num_experts = pos("expert_count");
    c.num_experts_per_tok = pos("expert_used_count");
    c.moe_intermediate = pos("expert_feed_forward_length");
    c.shared_intermediate = g.get_int(a + "expert_shared_feed_forward_length", 0);
    if (c.num_experts_per_tok > c.num_experts) fail(src + ": expert_used_count exceeds expert_count");
  }
  c.norm_topk_prob = true;

  c.tie_word_embeddings = !g.has_tensor("output.weight");
  c.max_position_embeddings = g.get_int(a + "context_length", 0);
  for (const char* k : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"})
    if (g.has(k)) {
      const int64_t id = g.get_int(k);
      bool dup = false;
      for (int64_t e : c.eos_token_ids) dup = dup || e == id;
      if (!dup) c.eos_token_ids.push_back(id);
    }
  // llama.cpp computes RoPE's inverse frequencies in f32; leave torch_dtype
  // empty so flashmoe does the same.
  return c;
}

}  // namespace flashmoe
