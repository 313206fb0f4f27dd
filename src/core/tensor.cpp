#include "core/tensor.h"

namespace flashmoe {

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string TensorView::shape_str() const { return shape_to_string(shape); }

}  // namespace flashmoe
