// A weight matrix as the ops see it: row-major [rows, cols] in one of the
// storage formats. Views into mmapped checkpoints or expert buffers; never
// owns memory.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace flashmoe {

// Group-wise affine quantisation along the input dimension (the MLX layout):
// w[r, c] = q[r, c] * scale[r, c / group] + bias[r, c / group], scale and bias
// in bf16. Q8 stores one byte per weight; Q4 packs 8 weights per uint32,
// lowest nibble first (so byte i holds weights 2i (low) and 2i+1 (high)).
//
// The GGUF kinds (Q8_0 ... IQ4_XS) are ggml's block formats: each row is a
// run of self-contained blocks of 32 or 256 weights with their scales inside
// (core/block_quant.h has the layouts); scales / biases / group are unused.
enum class QuantKind : uint8_t {
  None, Q8, Q4,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
};

inline int quant_bits(QuantKind q) { return q == QuantKind::Q8 ? 8 : q == QuantKind::Q4 ? 4 : 0; }
// True for the GGUF block formats.
inline bool quant_is_block(QuantKind q) { return q >= QuantKind::Q8_0; }
// Weights per block and bytes per block of a GGUF block format.
int64_t block_elems(QuantKind q);
int64_t block_bytes(QuantKind q);
const char* quant_name(QuantKind q);  // "none", "q8", "q4", "Q8_0", "Q4_K", ...

struct Matrix {
  DType dtype = DType::F32;  // element type when quant == None
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  QuantKind quant = QuantKind::None;
  const uint16_t* scales = nullptr;  // bf16 [rows, cols / group]
  const uint16_t* biases = nullptr;  // bf16 [rows, cols / group]
  int32_t group = 0;

  bool empty() const { return data == nullptr; }
  bool quantized() const { return quant != QuantKind::None; }
  // MLX group-wise affine (scales / biases beside the data).
  bool affine() const { return quantized() && !quant_is_block(quant); }
  bool block_quantized() const { return quant_is_block(quant); }
  int64_t groups_per_row() const { return affine() ? cols / group : 0; }
  size_t row_bytes() const {
    if (block_quantized()) return size_t(cols / block_elems(quant)) * size_t(block_bytes(quant));
    return quantized() ? size_t(cols) * quant_bits(quant) / 8 : size_t(cols) * dtype_size(dtype);
  }
  size_t nbytes() const { return size_t(rows) * row_bytes(); }
  // Bytes of the scales (and again of the biases) of a quantised matrix.
  size_t scale_bytes() const { return size_t(rows) * groups_per_row() * 2; }
  // Rows [r0, r0 + n) as a matrix of their own.
  Matrix slice_rows(int64_t r0, int64_t n) const {
    Matrix m = *this;
    m.data = static_cast<const uint8_t*>(data) + size_t(r0) * row_bytes();
    if (affine()) {
      m.scales = scales + r0 * groups_per_row();
      m.biases = biases + r0 * groups_per_row();
    }
    m.rows = n;
    return m;
  }
};

}  // namespace flashmoe
