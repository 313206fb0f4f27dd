// Rows of a weight Matrix in fp32, whatever its storage: widened from
// bf16 / f16 / f32 (core/simd.h), or dequantised from group-wise affine q8 / q4
// (Matrix::quant) on the fly, a group of 64 at a time, so a quantised expert
// is read from memory at 1/2 or 1/4 the bytes of bf16. Vector paths (AVX2, AVX-512)
// chosen at run time. Used by the CPU backend's products, the expert packer (experts/
// quantize.cpp) and the CUDA backend's upload.
#pragma once
#include <cstdint>

#include "core/cpu_features.h"
#include "core/matrix.h"

namespace flashmoe::cpu {

// Row r of W (any storage) as fp32 (out: W.cols floats).
void load_row(const Matrix& W, int64_t r, float* out);

// Row r of a quantised W as fp32 (out: W.cols floats).
void quant_dequant_row(const Matrix& W, int64_t r, float* out);
// dot(W[r, :], x) for a quantised W.
float quant_dot_row(const Matrix& W, int64_t r, const float* x);

}  // namespace flashmoe::cpu

namespace flashmoe::cpu {
// The kernels of `level` (<= cpu_level_supported()) whatever cpu_level() is:
// the tests run every level.
void quant_dequant_row_at(CpuLevel level, const Matrix& W, int64_t r, float* out);
float quant_dot_row_at(CpuLevel level, const Matrix& W, int64_t r, const float* x);
}  // namespace flashmoe::cpu
