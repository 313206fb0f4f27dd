// A weight matrix as the ops see it: row-major [rows, cols] in one of the
// storage formats. Views into mmapped checkpoints or expert buffers; never
// owns memory.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/dtype.h"

namespace flashmoe {

// Group-wise affine quantisation along the input dimension (the MLX layout):
// w[r, c] = q[r, c] * scale[r, c / group] + bias[r, c / group], scale and bias
// in bf16. Q8 stores one byte per weight; Q4 packs 8 weights per uint32,
// lowest nibble first (so byte i holds weights 2i (low) and 2i+1 (high)).
//
// Fp8Block (Qwen's / DeepSeek's FP8 releases): one E4M3 code per weight and
// one fp32 scale per block of block_rows x group weights (the checkpoint's
// `weight_scale_inv`): w[r, c] = e4m3(q[r, c]) * block_scales[r / block_rows,
// c / group]; edge blocks may be partial.
//
// The GGUF kinds (Q8_0 ... IQ4_XS) are ggml's block formats: each row is a
// run of self-contained blocks of 32 or 256 weights with their scales inside
// (core/block_quant.h has the layouts); scales / biases / group are unused.
enum class QuantKind : uint8_t {
  None, Q8, Q4, Fp8Block,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
};

inline int quant_bits(QuantKind q) {
  return q == QuantKind::Q8 || q == QuantKind::Fp8Block ? 8 : q == QuantKind::Q4 ? 4 : 0;
}
// True for the GGUF block formats.
inline bool quant_is_block(QuantKind q) { return q >= QuantKind::Q8_0; }
// Weights per block and bytes per block of a GGUF block format.
int64_t block_elems(QuantKind q);
int64_t block_bytes(QuantKind q);
const char* quant_name(QuantKind q);  // "none", "q8", "q4", "fp8", "Q8_0", "Q4_K", ...

struct Matrix {
  DType dtype = DType::F32;  // element type when quant == None
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  QuantKind quant = QuantKind::None;
  const uint16_t* scales = nullptr;  // bf16 [rows, cols / group]
  const uint16_t* biases = nullptr;  // bf16 [rows, cols / group]
  int32_t group = 0;                 // columns per group (Fp8Block: per block)
  // Fp8Block only: fp32 [ceil((block_row0 + rows) / block_rows), blocks_per_row()].
  // block_row0 is where row 0 sits inside its block row (a slice's offset).
  const float* block_scales = nullptr;
  int32_t block_rows = 0, block_row0 = 0;

  bool empty() const { return data == nullptr; }
  bool quantized() const { return quant != QuantKind::None; }
  bool fp8() const { return quant == QuantKind::Fp8Block; }
  // MLX group-wise affine Q8 / Q4 (scales / biases per group beside the data).
  bool affine() const { return quant == QuantKind::Q8 || quant == QuantKind::Q4; }
  bool block_quantized() const { return quant_is_block(quant); }
  int64_t groups_per_row() const { return affine() ? cols / group : 0; }
  int64_t blocks_per_row() const { return fp8() ? (cols + group - 1) / group : 0; }
  // The scale of Fp8Block row r's block b (read bytewise: safetensors does
  // not align a tensor to its element size).
  float block_scale(int64_t r, int64_t b) const {
    float s;
    std::memcpy(&s, block_scales + (block_row0 + r) / block_rows * blocks_per_row() + b, 4);
    return s;
  }
  size_t row_bytes() const {
    if (block_quantized()) return size_t(cols / block_elems(quant)) * size_t(block_bytes(quant));
    return quantized() ? size_t(cols) * quant_bits(quant) / 8 : size_t(cols) * dtype_size(dtype);
  }
  size_t nbytes() const { return size_t(rows) * row_bytes(); }
  // Bytes of the scales (and again of the biases) of a Q8 / Q4 matrix.
  size_t scale_bytes() const { return size_t(rows) * groups_per_row() * 2; }
  // Bytes of an Fp8Block matrix's block scales.
  size_t block_scale_bytes() const {
    return fp8() ? size_t((block_row0 + rows + block_rows - 1) / block_rows) * blocks_per_row() * 4 : 0;
  }
  // Rows [r0, r0 + n) as a matrix of their own.
  Matrix slice_rows(int64_t r0, int64_t n) const {
    Matrix m = *this;
    m.data = static_cast<const uint8_t*>(data) + size_t(r0) * row_bytes();
    if (fp8()) {
      m.block_scales = block_scales + (block_row0 + r0) / block_rows * blocks_per_row();
      m.block_row0 = int32_t((block_row0 + r0) % block_rows);
    } else if (affine()) {
      m.scales = scales + r0 * groups_per_row();
      m.biases = biases + r0 * groups_per_row();
    }
    m.rows = n;
    return m;
  }
};

}  // namespace flashmoe
