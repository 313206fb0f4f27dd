#include "format/quantization_config.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace flashmoe {

using nlohmann::json;

GroupQuant MlxQuantization::of(const std::string& module) const {
  auto it = modules.find(module);
  return it != modules.end() ? it->second : dflt;
}

namespace {

// One {group_size, bits} object; `what` names it in errors.
GroupQuant group_quant(const json& q, const std::string& what) {
  if (!q.contains("group_size") || !q["group_size"].is_number_integer() || !q.contains("bits") ||
      !q["bits"].is_number_integer())
    fail(what + " must have integer 'group_size' and 'bits'");
  if (q.contains("mode") && !(q["mode"].is_string() && q["mode"].get<std::string>() == "affine"))
    fail(what + ": mode " + q["mode"].dump() + " is not supported (flashmoe runs MLX's 'affine' quantisation)");
  GroupQuant g{q["bits"].get<int>(), q["group_size"].get<int>()};
  if (g.bits != 4 && g.bits != 8)
    fail(what + ": bits " + std::to_string(g.bits) + " is not supported (flashmoe runs 4- and 8-bit codes)");
  if (g.group <= 0 || g.group % 8 != 0)
    fail(what + ": group_size " + std::to_string(g.group) + " is not supported (a positive multiple of 8: 32, 64, 128)");
  return g;
}

MlxQuantization parse_mlx(const json& q, const std::string& source) {
  MlxQuantization m;
  if (!q.is_object()) fail(source + ": 'quantization' must be an object");
  m.present = true;
  m.dflt = group_quant(q, source + ": 'quantization'");
  for (auto it = q.begin(); it != q.end(); ++it) {
    const std::string& k = it.key();
    if (k == "group_size" || k == "bits" || k == "mode") continue;
    const std::string what = source + ": 'quantization' of module '" + k + "'";
    if (it->is_boolean()) m.modules[k] = it->get<bool>() ? m.dflt : GroupQuant{};
    else if (it->is_object()) m.modules[k] = group_quant(*it, what);
    else fail(what + " must be an object {group_size, bits} or a boolean");
  }
  return m;
}

Fp8BlockQuantization parse_fp8(const json& q, const std::string& source) {
  Fp8BlockQuantization f;
  const std::string what = source + ": 'quantization_config'";
  if (!q.contains("weight_block_size") || !q["weight_block_size"].is_array() || q["weight_block_size"].size() != 2 ||
      !q["weight_block_size"][0].is_number_integer() || !q["weight_block_size"][1].is_number_integer())
    fail(what + ": fp8 needs 'weight_block_size' [rows, cols] (per-tensor or per-channel FP8 is not supported)");
  f.block_rows = q["weight_block_size"][0].get<int>();
  f.block_cols = q["weight_block_size"][1].get<int>();
  if (f.block_rows <= 0 || f.block_cols <= 0 || f.block_cols % 16 != 0)
    fail(what + ": weight_block_size [" + std::to_string(f.block_rows) + ", " + std::to_string(f.block_cols) +
         "] is not supported (positive, columns a multiple of 16)");
  if (q.contains("activation_scheme") && !(q["activation_scheme"].is_string() &&
                                           q["activation_scheme"].get<std::string>() == "dynamic"))
    fail(what + ": activation_scheme " + q["activation_scheme"].dump() +
         " is not supported (only 'dynamic': no stored activation scales)");
  if (q.contains("fmt") && !(q["fmt"].is_string() && q["fmt"].get<std::string>() == "e4m3"))
    fail(what + ": fmt " + q["fmt"].dump() + " is not supported (F8_E4M3 only)");
  if (q.contains("modules_to_not_convert") && !q["modules_to_not_convert"].is_null()) {
    if (!q["modules_to_not_convert"].is_array()) fail(what + ": 'modules_to_not_convert' must be a list of names");
    for (const json& n : q["modules_to_not_convert"]) {
      if (!n.is_string()) fail(what + ": 'modules_to_not_convert' must be a list of names");
      f.not_converted.push_back(n.get<std::string>());
    }
  }
  f.present = true;
  return f;
}

}  // namespace

QuantizationConfig parse_quantization_config(const std::string& json_text, const std::string& source) {
  QuantizationConfig out;
  json cfg = json::parse(json_text, nullptr, false);
  if (!cfg.is_object()) return out;  // parse_model_config reports a bad config.json
  const json* root = &cfg;
  if (!cfg.contains("quantization") && !cfg.contains("quantization_config") && cfg.contains("text_config") &&
      cfg["text_config"].is_object())
    root = &cfg["text_config"];
  if (root->contains("quantization") && !(*root)["quantization"].is_null())
    out.mlx = parse_mlx((*root)["quantization"], source);
  if (!out.mlx.present && root->contains("quantization_config") && !(*root)["quantization_config"].is_null()) {
    const json& q = (*root)["quantization_config"];
    if (!q.is_object() || !q.contains("quant_method") || !q["quant_method"].is_string())
      fail(source + ": 'quantization_config' must be an object with a 'quant_method'");
    const std::string method = q["quant_method"].get<std::string>();
    if (method == "fp8") out.fp8 = parse_fp8(q, source);
    else
      fail(source + ": quantization_config quant_method '" + method +
           "' is not supported (flashmoe reads bf16/f16/f32, MLX 'quantization' q4/q8, and 'fp8' blocks)");
  }
  return out;
}

}  // namespace flashmoe
