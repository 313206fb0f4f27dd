// An HF checkpoint directory: one or more safetensors files (sharded through
// model.safetensors.index.json) and the naming scheme of the text model
// (`model.language_model.*` in multimodal wrappers, `model.*` otherwise).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/matrix.h"
#include "core/tensor.h"
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
  Matrix matrix(const std::string& name, int64_t rows, int64_t cols) const;
  TensorView expect(const std::string& name, const std::vector<int64_t>& shape) const;
  std::vector<float> vector_f32(const std::string& name, const std::vector<int64_t>& shape) const;

  const std::string& prefix() const { return prefix_; }
  int64_t total_bytes() const;

 private:
  std::string full_name(const std::string& name) const;

  std::string dir_, prefix_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

}  // namespace flashmoe
