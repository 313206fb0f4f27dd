// Qwen3.5 / Qwen3-Next: three GatedDeltaNet layers for every gated attention
// layer (config.json's layer_types or full_attention_interval), each followed
// by a routed MoE (with a shared expert when shared_expert_intermediate_size
// is set) or, for mlp_only_layers / decoder_sparse_step, a dense SwiGLU.
#include <cmath>

#include "core/dtype.h"
#include "model/plan.h"

namespace flashmoe {

ModelPlan make_plan(const ModelConfig& c) {
  ModelPlan p;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerPlan l;
    l.index = int(i);
    if (c.layer_kinds[size_t(i)] == LayerKind::Full) {
      l.mixer = MixerKind::GatedAttention;
      l.state_slot = p.attention_layers++;
    } else {
      l.mixer = MixerKind::GatedDeltaNet;
      l.state_slot = p.delta_layers++;
    }
    if (c.layer_is_moe[size_t(i)]) {
      l.ffn = FfnKind::RoutedMoE;
      l.shared_expert = c.shared_intermediate > 0;
      l.moe_slot = p.moe_layers++;
    }
    p.layers.push_back(l);
  }
  const int64_t rd = c.rotary_dim;
  for (int64_t i = 0; i < rd / 2; ++i) {
    float f = float(1.0 / std::pow(c.rope_theta, double(2 * i) / double(rd)));
    if (c.torch_dtype == "bfloat16") f = bf16_to_f32(f32_to_bf16(f));
    else if (c.torch_dtype == "float16") f = f16_to_f32(f32_to_f16(f));
    p.rope_inv_freq.push_back(f);
  }
  return p;
}

LayerPlan make_mtp_layer_plan(const ModelConfig& c, bool moe) {
  LayerPlan l;
  l.index = int(c.num_layers);
  l.mixer = MixerKind::GatedAttention;
  l.state_slot = 0;
  if (moe) {
    l.ffn = FfnKind::RoutedMoE;
    l.shared_expert = c.shared_intermediate > 0;
    l.moe_slot = 0;
  }
  return l;
}

}  // namespace flashmoe
