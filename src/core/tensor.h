// A non-owning view of a tensor stored somewhere in host memory (usually an
// mmapped checkpoint). Shapes are row-major, [out, in] for weight matrices.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace flashmoe {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  std::string shape_str() const;
};

std::string shape_to_string(const std::vector<int64_t>& shape);

}  // namespace flashmoe
