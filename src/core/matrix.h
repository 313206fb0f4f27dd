// A weight matrix as the ops see it: row-major [rows, cols] in one of the
// storage formats. Views into mmapped checkpoints; never owns memory.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace flashmoe {

struct Matrix {
  DType dtype = DType::F32;
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;

  bool empty() const { return data == nullptr; }
  size_t row_bytes() const { return size_t(cols) * dtype_size(dtype); }
  size_t nbytes() const { return size_t(rows) * row_bytes(); }
  // Rows [r0, r0 + n) as a matrix of their own.
  Matrix slice_rows(int64_t r0, int64_t n) const {
    Matrix m = *this;
    m.data = static_cast<const uint8_t*>(data) + size_t(r0) * row_bytes();
    m.rows = n;
    return m;
  }
};

}  // namespace flashmoe
