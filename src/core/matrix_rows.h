// Rows of a weight Matrix in fp32, whatever its storage: widened from
// bf16 / f16 / f32 (core/simd.h), or dequantised from group-wise affine q8 / q4
// (Matrix::quant) on the fly, a group of 64 at a time, so a quantised expert
// is read from memory at 1/2 or 1/4 the bytes of bf16. Vector paths (AVX2, AVX-512)
// chosen at run time; at the AVX512-VNNI level a one-token product can also
// run in int8 against activations quantised per group (Int8Activations). Used by the CPU backend's products, the expert packer (experts/
// quantize.cpp) and the CUDA backend's upload.
#pragma once
#include <cstdint>
#include <vector>

#include "core/cpu_features.h"
#include "core/matrix.h"

namespace flashmoe::cpu {

// Row r of W (any storage) as fp32 (out: W.cols floats).
void load_row(const Matrix& W, int64_t r, float* out);

// Row r of a quantised W as fp32 (out: W.cols floats).
void quant_dequant_row(const Matrix& W, int64_t r, float* out);
// dot(W[r, :], x) for a quantised W.
float quant_dot_row(const Matrix& W, int64_t r, const float* x);

// One token's activations quantised for the int8 dot products of q8 / q4
// rows: per group of `group` columns, codes in [-127, 127] with
// x ~ scale * code (scale = absmax / 127, round to nearest), and the exact
// fp32 sum of the group's x (the bias term needs no rounding). Each code is
// off by at most scale / 2, so a row's dot is off by at most
// sum_g |s_g| * scale_g / 2 * sum_c q_c (see quant_dot_row_int8).
struct Int8Activations {
  int64_t group = 0;
  std::vector<int8_t> code;
  std::vector<float> scale, sum;  // per group
};
void quantize_activations(const float* x, int64_t cols, int64_t group, Int8Activations& out);

// Whether quant_dot_row_int8_at runs at `level` for W: the AVX512-VNNI level
// and groups that are a multiple of 32.
bool int8_dot_supported(CpuLevel level, const Matrix& W);
// dot(W[r, :], x) from x's Int8Activations (same group as W):
// sum_g s_g * scale_g * sum_c q_c code_c + b_g * sum_g(x), the integer sums
// by vpdpbusd (u8 weight codes x s8 activation codes, 32 per instruction).
float quant_dot_row_int8_at(CpuLevel level, const Matrix& W, int64_t r, const Int8Activations& x);

}  // namespace flashmoe::cpu

namespace flashmoe::cpu {
// The kernels of `level` (<= cpu_level_supported()) whatever cpu_level() is:
// the tests run every level.
void quant_dequant_row_at(CpuLevel level, const Matrix& W, int64_t r, float* out);
float quant_dot_row_at(CpuLevel level, const Matrix& W, int64_t r, const float* x);
}  // namespace flashmoe::cpu
