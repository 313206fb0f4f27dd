#include "experts/quantize.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/matrix_rows.h"

namespace flashmoe {

Matrix QuantizedMatrix::view() const {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.data = data.data();
  if (quant == QuantKind::None) {
    m.dtype = DType::BF16;
  } else {
    m.dtype = DType::U8;
    m.quant = quant;
    m.group = group;
    m.scales = scales.data();
    m.biases = biases.data();
  }
  return m;
}

void quantize_row(const float* w, int64_t cols, QuantKind kind, int32_t group, uint8_t* q, uint16_t* scales,
                  uint16_t* biases) {
  const int bits = quant_bits(kind);
  const int levels = (1 << bits) - 1;
  if (bits == 4) std::fill(q, q + cols / 2, uint8_t(0));
  for (int64_t g = 0; g * group < cols; ++g) {
    const float* x = w + g * group;
    float lo = x[0], hi = x[0];
    for (int32_t i = 1; i < group; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
    const float b = bf16_to_f32(f32_to_bf16(lo));
    // Scale chosen so the rounded grid still reaches the group's maximum.
    float s = (hi - b) / float(levels);
    uint16_t s16 = f32_to_bf16(s);
    if (bf16_to_f32(s16) * levels + b < hi) s16 = uint16_t(s16 + 1);  // bf16 codes of positives are monotone
    if (!(hi > b)) s16 = f32_to_bf16(1.0f);  // constant group: any scale, code 0 (or the few above) is exact
    const float sr = bf16_to_f32(s16);
    scales[g] = s16;
    biases[g] = f32_to_bf16(b);
    for (int32_t i = 0; i < group; ++i) {
      int v = int(std::lrint((x[i] - b) / sr));
      v = std::clamp(v, 0, levels);
      const int64_t c = g * group + i;
      if (bits == 8) q[c] = uint8_t(v);
      else q[c >> 1] |= uint8_t(v << ((c & 1) * 4));
    }
  }
}

QuantizedMatrix quantize_matrix(const Matrix& src, QuantKind kind, int32_t group) {
  QuantizedMatrix out;
  out.quant = kind;
  out.rows = src.rows;
  out.cols = src.cols;
  std::vector<float> row(size_t(src.cols));
  if (kind == QuantKind::None) {
    out.data.resize(size_t(src.rows * src.cols) * 2);
    uint16_t* d = reinterpret_cast<uint16_t*>(out.data.data());
    for (int64_t r = 0; r < src.rows; ++r) {
      cpu::load_row(src, r, row.data());
      for (int64_t c = 0; c < src.cols; ++c) d[r * src.cols + c] = f32_to_bf16(row[c]);
    }
    return out;
  }
  if (group <= 0 || group % 8 != 0 || src.cols % group != 0)
    fail("cannot quantise a matrix of " + std::to_string(src.cols) + " columns in groups of " +
         std::to_string(group) + " (the group must be a multiple of 8 that divides the columns)");
  out.group = group;
  const int64_t G = src.cols / group;
  const size_t rb = size_t(src.cols) * quant_bits(kind) / 8;
  out.data.resize(size_t(src.rows) * rb);
  out.scales.resize(size_t(src.rows * G));
  out.biases.resize(size_t(src.rows * G));
  for (int64_t r = 0; r < src.rows; ++r) {
    cpu::load_row(src, r, row.data());
    quantize_row(row.data(), src.cols, kind, group, out.data.data() + r * rb, out.scales.data() + r * G,
                 out.biases.data() + r * G);
  }
  return out;
}

}  // namespace flashmoe
