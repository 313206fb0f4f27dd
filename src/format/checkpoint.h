// An HF checkpoint directory: one or more safetensors files (sharded through
// model.safetensors.index.json) and the naming scheme of the text model
// (`model.language_model.*` in multimodal wrappers, `model.*` otherwise,
// `language_model.model.*` as mlx-lm saves a Qwen3.5 wrapper).
#pragma once
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/matrix.h"
#include "core/tensor.h"
#include "format/quantization_config.h"
#include "format/safetensors.h"

namespace flashmoe {

class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);  // throws Error naming what is missing or bad

  const std::string& dir() const { return dir_; }
  // `name` is relative to the text-model prefix ("layers.0.mlp.gate.weight");
  // names starting with "/" are absolute ("/lm_head.weight").
  bool has(const std::string& name) const;
  TensorView get(const std::string& name) const;  // throws Error if missing

  // Typed accessors that check the shape and name the tensor on mismatch.
  // matrix() also reads MLX group-wise quantised weights: `X.weight` packed
  // into U32/I32 [rows, cols * bits / 32] beside bf16 `X.scales` and
  // `X.biases` [rows, cols / group], as config.json's `quantization` says
  // (its default, or the override for module X); and FP8 block-quantised
  // weights: `X.weight` F8_E4M3 [rows, cols] beside F32 `X.weight_scale_inv`
  // [ceil(rows / br), ceil(cols / bc)], as `quantization_config` says.
  Matrix matrix(const std::string& name, int64_t rows, int64_t cols) const;
  // `count` matrices of [rows, cols] stacked in one tensor [count, rows, cols]
  // (mlx-lm's switch_mlp experts), as one Matrix of count * rows rows.
  Matrix stacked_matrix(const std::string& name, int64_t count, int64_t rows, int64_t cols) const;
  // The name of the output projection ("/lm_head.weight", or mlx-lm's
  // "/language_model.lm_head.weight" beside `language_model.model.*`).
  std::string lm_head_name() const;
  const QuantizationConfig& quantization() const { return quant_; }
  TensorView expect(const std::string& name, const std::vector<int64_t>& shape) const;
  std::vector<float> vector_f32(const std::string& name, const std::vector<int64_t>& shape) const;

  const std::string& prefix() const { return prefix_; }
  // Every tensor's full name, sorted.
  std::vector<std::string> tensor_names() const;
  // Tensors of the text model (under prefix()) that no get() has asked for
  // yet, sorted: after loading, these are weights config.json does not
  // describe (e.g. it lists fewer layers than the checkpoint holds).
  std::vector<std::string> unused_tensors() const;
  int64_t total_bytes() const;

 private:
  std::string full_name(const std::string& name) const;

  // lead 0: a plain [rows, cols] matrix; otherwise [lead, rows, cols].
  Matrix any_matrix(const std::string& name, int64_t lead, int64_t rows, int64_t cols) const;
  Matrix quantized_matrix(const TensorView& w, int64_t lead, int64_t rows, int64_t cols) const;
  Matrix fp8_matrix(const TensorView& w, int64_t lead, int64_t rows, int64_t cols) const;

  std::string dir_, prefix_;
  QuantizationConfig quant_;  // from config.json
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
  mutable std::set<std::string> used_;  // full names get() has returned (loading is single-threaded)
};

}  // namespace flashmoe
