// Writes a model as an MLX-style checkpoint (tests): the weights picked are
// stored as group-wise affine q4 / q8 codes with bf16 scales and biases,
// the layout mlx-community checkpoints use.
#pragma once
#include <sys/stat.h>

#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "experts/quantize.h"
#include "format/checkpoint.h"
#include "format/safetensors.h"
#include "core/mapped_file.h"
#include "test_util.h"

namespace flashmoe::test {

// Writes `src` as an MLX-style checkpoint in our naming: every 2-D
// `.weight` for which `bits_of` returns 4 or 8 becomes U32-packed weights +
// bf16 scales and biases (group 64); config.json's `quantization` gets
// `default_bits` and an override for each module quantised otherwise.
inline void write_mlx_modules(const std::string& src, const std::string& dst,
                              const std::function<int(const std::string&)>& bits_of, int default_bits) {
  Checkpoint ck(src);
  std::vector<QuantizedMatrix> keep;
  keep.reserve(4096);
  std::vector<TensorToWrite> out;
  nlohmann::json quant = {{"group_size", 64}, {"bits", default_bits}};
  for (const std::string& n : ck.tensor_names()) {
    TensorView t = ck.get("/" + n);
    const bool weight = t.shape.size() == 2 && t.shape[1] % 64 == 0 && n.size() > 7 &&
                        n.compare(n.size() - 7, 7, ".weight") == 0;
    const int bits = weight ? bits_of(n) : 0;
    if (bits == 0) {
      out.push_back({n, t.dtype, t.shape, t.data});
      continue;
    }
    Matrix m{t.dtype, t.data, t.shape[0], t.shape[1]};
    keep.push_back(quantize_matrix(m, bits == 4 ? QuantKind::Q4 : QuantKind::Q8, 64));
    const QuantizedMatrix& q = keep.back();
    const std::string stem = n.substr(0, n.size() - 7);
    if (bits != default_bits) quant[stem] = {{"group_size", 64}, {"bits", bits}};
    out.push_back({n, DType::U32, {q.rows, q.cols * bits / 32}, q.data.data()});
    out.push_back({stem + ".scales", DType::BF16, {q.rows, q.cols / 64}, q.scales.data()});
    out.push_back({stem + ".biases", DType::BF16, {q.rows, q.cols / 64}, q.biases.data()});
  }
  ::mkdir(dst.c_str(), 0755);
  write_safetensors(dst + "/model.safetensors", out);
  nlohmann::json cfg = nlohmann::json::parse(read_text_file(src + "/config.json"));
  cfg["quantization"] = quant;
  FILE* f = std::fopen((dst + "/config.json").c_str(), "w");
  std::fputs(cfg.dump().c_str(), f);
  std::fclose(f);
}

// Writes `src` as an MLX-style checkpoint with every 2-D `.weight` whose name
// passes `pick` quantised to `bits`.
inline void write_mlx(const std::string& src, const std::string& dst, bool (*pick)(const std::string&), int bits = 4) {
  write_mlx_modules(src, dst, [&](const std::string& n) { return pick(n) ? bits : 0; }, bits);
}

// What write_mlx quantises for an mlx-community-like checkpoint: every
// linear weight but the router and the shared-expert gate, which mlx-lm also
// keeps at higher precision (embeddings and lm_head included).
inline bool mlx_all_linear(const std::string& n) {
  return n.find(".mlp.gate.weight") == std::string::npos && n.find("shared_expert_gate") == std::string::npos;
}

}  // namespace flashmoe::test

namespace flashmoe::test {
// mlx-lm's quant_predicate for Qwen3.5-MoE / Qwen3-Next: every linear weight
// at the default bits, the router and the shared-expert gate at 8 bits.
inline int mlx_lm_bits(const std::string& n) {
  return n.find(".mlp.gate.weight") != std::string::npos || n.find("shared_expert_gate") != std::string::npos ? 8 : 4;
}
}  // namespace flashmoe::test
