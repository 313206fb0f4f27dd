#include "kv/presets.h"

#include "core/error.h"

namespace flashmoe {

namespace {

struct Preset {
  const char* name;
  bool next;  // Qwen3-Next (flat config) vs Qwen3.5 (multimodal wrapper)
  int64_t hidden, layers, heads, kv_heads, head_dim;
  int64_t nk, nv, dk, dv;
  int64_t experts, topk, moe_inter, shared_inter, vocab;
};

// docs/MODEL.md, "Published sizes".
const Preset kPresets[] = {
    {"qwen3.5-35b-a3b", false, 2048, 40, 16, 2, 256, 16, 32, 128, 128, 256, 8, 512, 512, 248320},
    {"qwen3.5-122b-a10b", false, 3072, 48, 32, 2, 256, 16, 64, 128, 128, 256, 8, 1024, 1024, 248320},
    {"qwen3.5-397b-a17b", false, 4096, 60, 32, 2, 256, 16, 64, 128, 128, 512, 10, 1024, 1024, 248320},
    {"qwen3-next-80b-a3b", true, 2048, 48, 16, 2, 256, 16, 32, 128, 128, 512, 10, 512, 512, 151936},
};

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.push_back(p.name);
  return out;
}

ModelConfig model_preset(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name != p.name) continue;
    ModelConfig c;
    c.model_type = p.next ? "qwen3_next" : "qwen3_5_moe";
    c.family = p.next ? Family::Qwen3Next : Family::Qwen35;
    c.multimodal_wrapper = !p.next;
    c.vocab_size = p.vocab;
    c.hidden_size = p.hidden;
    c.num_layers = p.layers;
    for (int64_t i = 0; i < p.layers; ++i)
      c.layer_kinds.push_back((i + 1) % 4 == 0 ? LayerKind::Full : LayerKind::Linear);
    c.num_heads = p.heads;
    c.num_kv_heads = p.kv_heads;
    c.head_dim = p.head_dim;
    c.rope_theta = 1e7;
    c.partial_rotary_factor = 0.25;
    c.rotary_dim = p.head_dim / 4;
    c.lin_num_k_heads = p.nk;
    c.lin_num_v_heads = p.nv;
    c.lin_k_dim = p.dk;
    c.lin_v_dim = p.dv;
    c.conv_kernel = 4;
    c.num_experts = p.experts;
    c.num_experts_per_tok = p.topk;
    c.moe_intermediate = p.moe_inter;
    c.shared_intermediate = p.shared_inter;
    c.norm_topk_prob = true;
    c.layer_is_moe.assign(size_t(p.layers), true);
    c.max_position_embeddings = 262144;
    return c;
  }
  std::string names;
  for (const auto& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  fail("unknown model preset '" + name + "' (known: " + names + ")");
}

}  // namespace flashmoe
