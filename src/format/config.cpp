#include "format/config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"

namespace flashmoe {

using nlohmann::json;

int64_t ModelConfig::num_full_layers() const {
  return std::count(layer_kinds.begin(), layer_kinds.end(), LayerKind::Full);
}
int64_t ModelConfig::num_linear_layers() const {
  return std::count(layer_kinds.begin(), layer_kinds.end(), LayerKind::Linear);
}

namespace {

struct Reader {
  const json& j;
  const std::string& source;

  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    fail(source + ": field '" + key + "' " + why);
  }
  int64_t int_req(const std::string& key) const {
    if (!j.contains(key)) bad(key, "is missing");
    if (!j[key].is_number_integer()) bad(key, "must be an integer");
    int64_t v = j[key].get<int64_t>();
    if (v <= 0) bad(key, "must be positive (got " + std::to_string(v) + ")");
    return v;
  }
  int64_t int_opt(const std::string& key, int64_t def) const {
    if (!j.contains(key) || j[key].is_null()) return def;
    if (!j[key].is_number_integer()) bad(key, "must be an integer");
    int64_t v = j[key].get<int64_t>();
    if (v < 0) bad(key, "must not be negative");
    return v;
  }
  double num_opt(const json& obj, const std::string& key, double def) const {
    if (!obj.contains(key) || obj[key].is_null()) return def;
    if (!obj[key].is_number()) bad(key, "must be a number");
    return obj[key].get<double>();
  }
  bool bool_opt(const std::string& key, bool def) const {
    if (!j.contains(key) || j[key].is_null()) return def;
    if (!j[key].is_boolean()) bad(key, "must be true or false");
    return j[key].get<bool>();
  }
};

void collect_eos(const json& v, std::vector<int64_t>* out) {
  if (v.is_number_integer()) out->push_back(v.get<int64_t>());
  if (v.is_array())
    for (const auto& e : v)
      if (e.is_number_integer()) out->push_back(e.get<int64_t>());
}

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail(source + ": not valid JSON (" + e.what() + ")");
  }
  if (!root.is_object()) fail(source + ": not a JSON object");
  ModelConfig c;
  if (!root.contains("model_type") || !root["model_type"].is_string())
    fail(source + ": no model_type; flashmoe supports qwen3_5_moe, qwen3_5_moe_text, qwen3_5, "
                  "qwen3_5_text, qwen3_next");
  c.model_type = root["model_type"].get<std::string>();
  const json* tj = &root;
  if (c.model_type == "qwen3_5_moe" || c.model_type == "qwen3_5") {
    if (!root.contains("text_config") || !root["text_config"].is_object())
      fail(source + ": model_type " + c.model_type + " needs a text_config object");
    tj = &root["text_config"];
    c.multimodal_wrapper = true;
    c.family = Family::Qwen35;
  } else if (c.model_type == "qwen3_5_moe_text" || c.model_type == "qwen3_5_text") {
    c.family = Family::Qwen35;
  } else if (c.model_type == "qwen3_next") {
    c.family = Family::Qwen3Next;
  } else {
    fail(source + ": unsupported model_type '" + c.model_type +
         "' (flashmoe supports qwen3_5_moe, qwen3_5_moe_text, qwen3_5, qwen3_5_text, qwen3_next)");
  }
  const json& t = *tj;
  Reader r{t, source};

  c.vocab_size = r.int_req("vocab_size");
  c.hidden_size = r.int_req("hidden_size");
  c.num_layers = r.int_req("num_hidden_layers");
  c.rms_norm_eps = float(r.num_opt(t, "rms_norm_eps", 1e-6));
  c.num_heads = r.int_req("num_attention_heads");
  c.num_kv_heads = r.int_opt("num_key_value_heads", c.num_heads);
  c.head_dim = r.int_opt("head_dim", c.hidden_size / c.num_heads);
  if (c.num_kv_heads == 0 || c.num_heads % c.num_kv_heads != 0)
    fail(source + ": num_attention_heads (" + std::to_string(c.num_heads) +
         ") must be a multiple of num_key_value_heads (" + std::to_string(c.num_kv_heads) + ")");

  // RoPE: rope_parameters (new) or top-level / rope_scaling (legacy).
  c.rope_theta = r.num_opt(t, "rope_theta", 1e4);
  c.partial_rotary_factor = r.num_opt(t, "partial_rotary_factor", 1.0);
  for (const char* k : {"rope_parameters", "rope_scaling"}) {
    if (t.contains(k) && t[k].is_object()) {
      c.rope_theta = r.num_opt(t[k], "rope_theta", c.rope_theta);
      c.partial_rotary_factor = r.num_opt(t[k], "partial_rotary_factor", c.partial_rotary_factor);
    }
  }
  c.rotary_dim = int64_t(std::llround(double(c.head_dim) * c.partial_rotary_factor));
  if (c.rotary_dim <= 0 || c.rotary_dim > c.head_dim || c.rotary_dim % 2)
    fail(source + ": partial_rotary_factor " + std::to_string(c.partial_rotary_factor) +
         " gives an invalid rotary dimension for head_dim " + std::to_string(c.head_dim));

  c.lin_num_k_heads = r.int_req("linear_num_key_heads");
  c.lin_num_v_heads = r.int_req("linear_num_value_heads");
  c.lin_k_dim = r.int_req("linear_key_head_dim");
  c.lin_v_dim = r.int_req("linear_value_head_dim");
  c.conv_kernel = r.int_opt("linear_conv_kernel_dim", 4);
  if (c.conv_kernel < 1) fail(source + ": linear_conv_kernel_dim must be at least 1");
  if (c.lin_num_v_heads % c.lin_num_k_heads != 0)
    fail(source + ": linear_num_value_heads must be a multiple of linear_num_key_heads");

  // Layer kinds.
  if (t.contains("layer_types") && !t["layer_types"].is_null()) {
    const json& lt = t["layer_types"];
    if (!lt.is_array() || int64_t(lt.size()) != c.num_layers)
      fail(source + ": layer_types must list " + std::to_string(c.num_layers) + " layers");
    for (const auto& e : lt) {
      std::string s = e.is_string() ? e.get<std::string>() : "";
      if (s == "full_attention") c.layer_kinds.push_back(LayerKind::Full);
      else if (s == "linear_attention") c.layer_kinds.push_back(LayerKind::Linear);
      else fail(source + ": unknown layer type '" + s + "' in layer_types");
    }
  } else {
    int64_t interval = r.int_opt("full_attention_interval", 4);
    if (interval == 0) interval = 4;
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layer_kinds.push_back((i + 1) % interval == 0 ? LayerKind::Full : LayerKind::Linear);
  }

  // Feed-forward.
  bool dense_type = c.model_type == "qwen3_5" || c.model_type == "qwen3_5_text";
  c.num_experts = dense_type ? 0 : r.int_opt("num_experts", 0);
  c.intermediate_size = r.int_opt("intermediate_size", 0);
  if (c.num_experts > 0) {
    c.num_experts_per_tok = r.int_req("num_experts_per_tok");
    c.moe_intermediate = r.int_req("moe_intermediate_size");
    c.shared_intermediate = r.int_opt("shared_expert_intermediate_size", 0);
    if (c.num_experts_per_tok > c.num_experts)
      fail(source + ": num_experts_per_tok exceeds num_experts");
  }
  c.norm_topk_prob = c.family == Family::Qwen3Next ? r.bool_opt("norm_topk_prob", true) : true;
  std::vector<int64_t> mlp_only;
  if (t.contains("mlp_only_layers") && t["mlp_only_layers"].is_array())
    for (const auto& e : t["mlp_only_layers"])
      if (e.is_number_integer()) mlp_only.push_back(e.get<int64_t>());
  int64_t sparse_step = r.int_opt("decoder_sparse_step", 1);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    bool moe = c.num_experts > 0 &&
               std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() &&
               (sparse_step <= 1 || (i + 1) % sparse_step == 0);
    c.layer_is_moe.push_back(moe);
    if (!moe && c.intermediate_size <= 0)
      fail(source + ": layer " + std::to_string(i) + " has a dense MLP but intermediate_size is missing");
  }

  // tie_word_embeddings may sit at either level of a wrapper config.
  c.tie_word_embeddings = r.bool_opt("tie_word_embeddings", false);
  if (c.multimodal_wrapper && root.contains("tie_word_embeddings") &&
      root["tie_word_embeddings"].is_boolean() && t.find("tie_word_embeddings") == t.end())
    c.tie_word_embeddings = root["tie_word_embeddings"].get<bool>();
  c.max_position_embeddings = r.int_opt("max_position_embeddings", 0);
  if (t.contains("eos_token_id")) collect_eos(t["eos_token_id"], &c.eos_token_ids);
  if (c.eos_token_ids.empty() && root.contains("eos_token_id")) collect_eos(root["eos_token_id"], &c.eos_token_ids);
  for (const json* obj : std::vector<const json*>{&t, &root})
    for (const char* k : {"dtype", "torch_dtype"})
      if (c.torch_dtype.empty() && obj->contains(k) && (*obj)[k].is_string()) c.torch_dtype = (*obj)[k].get<std::string>();
  return c;
}

ModelConfig load_model_config(const std::string& dir_or_file) {
  std::string path = dir_or_file;
  if (is_directory(dir_or_file)) path = dir_or_file + "/config.json";
  else if (!file_exists(dir_or_file)) fail("model directory or config not found: " + dir_or_file);
  if (!file_exists(path)) fail(dir_or_file + ": no config.json in model directory");
  return parse_model_config(read_text_file(path), path);
}

void limit_experts_per_token(ModelConfig* c, int64_t k) {
  if (c->num_experts == 0) fail("--moe-top-k: this model has no routed experts");
  if (k < 1 || k > c->num_experts_per_tok)
    fail("--moe-top-k " + std::to_string(k) + ": must be between 1 and the model's num_experts_per_tok (" +
         std::to_string(c->num_experts_per_tok) + ")");
  c->num_experts_per_tok = k;
}

}  // namespace flashmoe
