#include "model/synthetic_pack.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "core/xxhash64.h"
#include "experts/expert_layout.h"
#include "experts/manifest.h"
#include "format/safetensors.h"

namespace flashmoe {

namespace {

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// n bf16 values uniform in [-scale, scale).
void fill_bf16(uint16_t* p, size_t n, float scale, uint64_t& seed) {
  for (size_t i = 0; i < n; ++i)
    p[i] = f32_to_bf16((float(splitmix64(seed) >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale);
}

// One non-expert tensor: how to fill it (random in +-1/sqrt(fan-in), random
// in +-0.5 for the conv taps, or a constant) and, once made, its values.
struct OwnedTensor {
  std::string name;
  std::vector<int64_t> shape;
  enum { Matrix, Conv, Constant } fill = Matrix;
  float value = 0;
  std::vector<uint16_t> bf16;
  size_t numel() const {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    return n;
  }
};

// The checkpoint's non-expert tensors under their HF names, not yet filled.
std::vector<OwnedTensor> non_expert_tensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const int64_t nv = c.lin_num_v_heads, dv = c.lin_v_dim, C = c.lin_conv_dim(), K = c.conv_kernel;
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int64_t E = c.num_experts, Is = c.shared_intermediate;
  std::vector<OwnedTensor> t;
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols) {
    t.push_back(OwnedTensor{name, {rows, cols}, OwnedTensor::Matrix, 1.0f / std::sqrt(float(cols)), {}});
  };
  auto constant = [&](const std::string& name, std::vector<int64_t> shape, float v) {
    t.push_back(OwnedTensor{name, std::move(shape), OwnedTensor::Constant, v, {}});
  };
  matrix("model.embed_tokens.weight", V, H);
  constant("model.norm.weight", {H}, 0.0f);  // Qwen3.5 norms scale by 1 + w
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    constant(p + "input_layernorm.weight", {H}, 0.0f);
    constant(p + "post_attention_layernorm.weight", {H}, 0.0f);
    if (c.layer_kinds[size_t(i)] == LayerKind::Full) {
      matrix(p + "self_attn.q_proj.weight", 2 * nh * hd, H);
      matrix(p + "self_attn.k_proj.weight", nkv * hd, H);
      matrix(p + "self_attn.v_proj.weight", nkv * hd, H);
      matrix(p + "self_attn.o_proj.weight", H, nh * hd);
      constant(p + "self_attn.q_norm.weight", {hd}, 0.0f);
      constant(p + "self_attn.k_norm.weight", {hd}, 0.0f);
    } else {
      const std::string a = p + "linear_attn.";
      matrix(a + "in_proj_qkv.weight", C, H);
      matrix(a + "in_proj_z.weight", nv * dv, H);
      matrix(a + "in_proj_b.weight", nv, H);
      matrix(a + "in_proj_a.weight", nv, H);
      t.push_back(OwnedTensor{a + "conv1d.weight", {C, 1, K}, OwnedTensor::Conv, 0.5f, {}});
      constant(a + "dt_bias", {nv}, 0.0f);
      constant(a + "A_log", {nv}, 0.0f);  // A = -exp(0) = -1
      constant(a + "norm.weight", {dv}, 1.0f);  // a plain (not 1 + w) norm
      matrix(a + "out_proj.weight", H, nv * dv);
    }
    if (c.layer_is_moe[size_t(i)]) {
      matrix(p + "mlp.gate.weight", E, H);
      if (Is > 0) {
        matrix(p + "mlp.shared_expert.gate_proj.weight", Is, H);
        matrix(p + "mlp.shared_expert.up_proj.weight", Is, H);
        matrix(p + "mlp.shared_expert.down_proj.weight", H, Is);
        matrix(p + "mlp.shared_expert_gate.weight", 1, H);
      }
    } else {
      matrix(p + "mlp.gate_proj.weight", c.intermediate_size, H);
      matrix(p + "mlp.up_proj.weight", c.intermediate_size, H);
      matrix(p + "mlp.down_proj.weight", H, c.intermediate_size);
    }
  }
  return t;
}

void fill_tensor(OwnedTensor& t, uint64_t& seed) {
  t.bf16.resize(t.numel());
  if (t.fill == OwnedTensor::Constant) std::fill(t.bf16.begin(), t.bf16.end(), f32_to_bf16(t.value));
  else fill_bf16(t.bf16.data(), t.bf16.size(), t.value, seed);
}

// One expert record of `layout`: random codes whose scales and biases spread
// them over +-1/sqrt(fan-in) (value = code * scale + bias), or random bf16.
void fill_record(const ExpertLayout& layout, uint8_t* rec, uint64_t& seed) {
  std::fill(rec, rec + layout.bytes, uint8_t(0));
  for (const ExpertPart* part : {&layout.gate, &layout.up, &layout.down}) {
    const float r = 1.0f / std::sqrt(float(part->cols));
    if (layout.quant == QuantKind::None) {
      fill_bf16(reinterpret_cast<uint16_t*>(rec + part->offset), part->bytes / 2, r, seed);
      continue;
    }
    for (uint64_t i = 0; i + 8 <= part->bytes; i += 8) {
      const uint64_t v = splitmix64(seed);
      std::memcpy(rec + part->offset + i, &v, 8);
    }
    const size_t groups = size_t(part->rows * (part->cols / layout.group));
    const float top = float((1 << quant_bits(layout.quant)) - 1);
    const uint16_t s = f32_to_bf16(2 * r / top), b = f32_to_bf16(-r);
    for (size_t g = 0; g < groups; ++g) {
      std::memcpy(rec + part->scales + 2 * g, &s, 2);
      std::memcpy(rec + part->biases + 2 * g, &b, 2);
    }
  }
}

ExpertLayout layout_of(const ModelConfig& c, const PackOptions& opt) {
  if (opt.experts == QuantKind::Fp8Block) fail("pack --synthetic: --experts fp8 keeps a checkpoint's FP8 experts; pick bf16, q8 or q4");
  return ExpertLayout::make(c.hidden_size, c.moe_intermediate, opt.experts, opt.group);
}

void write_expert_file(const std::string& path, const ExpertLayout& layout, int64_t E, uint64_t seed,
                       const PackOptions& opt, PackedLayer* pl) {
  write_expert_records(path, layout, E, opt, pl, [&](int64_t, uint8_t* rec) { fill_record(layout, rec, seed); });
}

}  // namespace

std::string synthetic_config_json(const ModelConfig& c) {
  nlohmann::ordered_json t;
  t["model_type"] = "qwen3_5_moe_text";
  t["architectures"] = {"Qwen3_5MoeForCausalLM"};
  t["torch_dtype"] = "bfloat16";
  t["vocab_size"] = c.vocab_size;
  t["hidden_size"] = c.hidden_size;
  t["num_hidden_layers"] = c.num_layers;
  t["num_attention_heads"] = c.num_heads;
  t["num_key_value_heads"] = c.num_kv_heads;
  t["head_dim"] = c.head_dim;
  t["rms_norm_eps"] = c.rms_norm_eps;
  t["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta},
                          {"partial_rotary_factor", c.partial_rotary_factor}};
  t["linear_num_key_heads"] = c.lin_num_k_heads;
  t["linear_num_value_heads"] = c.lin_num_v_heads;
  t["linear_key_head_dim"] = c.lin_k_dim;
  t["linear_value_head_dim"] = c.lin_v_dim;
  t["linear_conv_kernel_dim"] = c.conv_kernel;
  nlohmann::ordered_json kinds = nlohmann::ordered_json::array();
  for (LayerKind k : c.layer_kinds) kinds.push_back(k == LayerKind::Full ? "full_attention" : "linear_attention");
  t["layer_types"] = kinds;
  t["num_experts"] = c.num_experts;
  t["num_experts_per_tok"] = c.num_experts_per_tok;
  t["moe_intermediate_size"] = c.moe_intermediate;
  t["shared_expert_intermediate_size"] = c.shared_intermediate;
  t["intermediate_size"] = c.intermediate_size;
  nlohmann::ordered_json dense = nlohmann::ordered_json::array();
  for (int64_t i = 0; i < c.num_layers; ++i)
    if (!c.layer_is_moe[size_t(i)]) dense.push_back(i);
  t["mlp_only_layers"] = dense;
  t["max_position_embeddings"] = c.max_position_embeddings;
  t["tie_word_embeddings"] = true;
  return t.dump(2) + "\n";
}

uint64_t synthetic_pack_bytes(const ModelConfig& c, const PackOptions& opt) {
  const ExpertLayout layout = layout_of(c, opt);
  uint64_t moe_layers = 0;
  for (int64_t i = 0; i < c.num_layers; ++i) moe_layers += c.layer_is_moe[size_t(i)] ? 1 : 0;
  uint64_t bytes = moe_layers * uint64_t(c.num_experts) * align_up(layout.bytes, kExpertAlign);
  for (const OwnedTensor& t : non_expert_tensors(c)) bytes += t.numel() * 2;
  return bytes;
}

void pack_synthetic(const ModelConfig& c, const std::string& out, const PackOptions& opt,
                    const PackProgress& progress) {
  if (file_exists(out) || is_directory(out)) fail("output " + out + " already exists; remove it or choose another -o");
  const ExpertLayout layout = layout_of(c, opt);
  build_packed_dir(out, [&](const std::string& tmp) {
    const std::string config = synthetic_config_json(c);
    write_text(tmp + "/config.json", config);
    {
      std::vector<OwnedTensor> owned = non_expert_tensors(c);
      uint64_t seed = 1;
      std::vector<TensorToWrite> tensors;
      for (OwnedTensor& t : owned) {
        fill_tensor(t, seed);
        tensors.push_back({t.name, DType::BF16, t.shape, t.bf16.data()});
      }
      write_safetensors(tmp + "/model.safetensors", tensors);
    }
    PackedManifest m;
    m.layout = layout;
    m.layers = write_layer_files(c, tmp, progress, [&](int64_t i, const std::string& path, PackedLayer* pl) {
      write_expert_file(path, layout, c.num_experts, 0x5eed0000ULL + uint64_t(i) * 0x100000001ULL, opt, pl);
    });
    if (opt.stop && *opt.stop) fail("interrupted by a signal");
    write_text(tmp + "/" + kManifestName, manifest_to_json(m, config));
  });
}

}  // namespace flashmoe
