// Group-wise affine quantisation (q8, q4; MLX-compatible layout, see
// core/matrix.h) of weights held in any float storage type.
#pragma once
#include <cstdint>
#include <vector>

#include "core/matrix.h"

namespace flashmoe {

// An owning quantised (or bf16) copy of a matrix; view() points into it.
struct QuantizedMatrix {
  QuantKind quant = QuantKind::None;
  int64_t rows = 0, cols = 0;
  int32_t group = 0;
  std::vector<uint8_t> data;      // packed weights (bf16 values when quant == None)
  std::vector<uint16_t> scales;   // bf16 [rows, cols / group]
  std::vector<uint16_t> biases;   // bf16 [rows, cols / group]
  Matrix view() const;
};

// Quantises one row of `cols` floats into q (cols * bits / 8 bytes) and
// cols / group bf16 scales and biases. Scale and bias are rounded to bf16
// first and the codes chosen against the rounded values, so dequantising
// reproduces exactly what the kernels compute.
void quantize_row(const float* w, int64_t cols, QuantKind kind, int32_t group, uint8_t* q, uint16_t* scales,
                  uint16_t* biases);

// Quantises a whole matrix (read in its own storage format). kind None gives
// a bf16 copy. Throws Error if cols is not a multiple of group.
QuantizedMatrix quantize_matrix(const Matrix& src, QuantKind kind, int32_t group);

}  // namespace flashmoe
