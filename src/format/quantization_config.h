// How a checkpoint's config.json says its weights are quantised. Two schemes:
//  - MLX (`"quantization": {"group_size", "bits", "mode"?, "<module>": {...} | false}`),
//    as mlx-lm's convert writes it: group-wise affine codes packed into
//    uint32 with bf16 scales and biases; keys other than the defaults name a
//    module (the tensor name without ".weight") that is quantised with its
//    own group size and bits (mlx-lm keeps the MoE router and the shared-expert
//    gate at 8 bits) or, with `false`, not at all.
//  - FP8 blocks (`"quantization_config": {"quant_method": "fp8",
//    "weight_block_size": [128, 128], "modules_to_not_convert": [...]}`),
//    Qwen's and DeepSeek's FP8 releases: F8_E4M3 weights with one F32
//    `weight_scale_inv` per block.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace flashmoe {

struct GroupQuant {
  int bits = 0, group = 0;  // bits 0: not quantised
};

struct MlxQuantization {
  bool present = false;
  GroupQuant dflt;
  std::map<std::string, GroupQuant> modules;  // per-module overrides (bits 0 for `false`)
  // The scheme of `module` (a full tensor name without ".weight").
  GroupQuant of(const std::string& module) const;
};

struct Fp8BlockQuantization {
  bool present = false;
  int block_rows = 0, block_cols = 0;
  std::vector<std::string> not_converted;  // modules_to_not_convert, as written
};

struct QuantizationConfig {
  MlxQuantization mlx;
  Fp8BlockQuantization fp8;
};

// Parses the quantisation keys of config.json text (top level, or the
// text_config of a multimodal wrapper); `source` names the file in errors.
// Throws Error naming the key and value flashmoe cannot run (bits other
// than 4 and 8, an MLX mode other than affine, a quant_method other than
// fp8, ...).
QuantizationConfig parse_quantization_config(const std::string& json_text, const std::string& source);

}  // namespace flashmoe
