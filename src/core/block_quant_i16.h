// One-token products of Q4_K / Q6_K / Q8_0 / Q5_0 rows against activations
// rounded to integers: the weight codes and the activation codes are
// multiplied and summed in int32 (vpmaddwd, 16 products per AVX2
// instruction), and the block's scales are applied once per 32 weights
// (per block of 256 in the 512-bit Q4_K / Q6_K kernels of avx512vnni).
// The decode matvec of a GGUF model spends most of its time here; widening
// every weight to fp32 and multiplying it with an fp32 activation took
// more instructions per weight.
//
// Accuracy: each activation is held as two int16 codes, x ~ a * (hi + lo /
// 65536) with a = max|x| / 32767 over its group of 256 columns (rows of
// whole 256-blocks, so that a K-quant kernel scales a whole block's sums
// at once) or of 32 (other rows): hi rounds x / a to nearest, lo rounds
// the rest (computed with one fma) in steps of 1/65536, so a value is off
// by at most a / 131072, ~2^-32 of its group's largest value. One
// int16 code alone (~2^-16) moved coder-mini Q4_K_M's decode logits by up
// to 0.28 over 256 positions (bench/NOTES.md, "GGUF decode with int16
// activations"); llama.cpp's int8 codes are ~2^-8. The integer sums are
// exact; the Q4_K min term uses the exact fp32 sum of the block's x.
#pragma once
#include <cstdint>
#include <vector>

#include "core/cpu_features.h"
#include "core/matrix.h"

namespace flashmoe::cpu {

// One token's activations in blocks of 32 columns: per block 32 high codes
// then 32 low codes, each 32 stored de-interleaved, the 16 even-indexed
// columns then the 16 odd-indexed ones: the kernels split a 16-bit lane of
// weight bytes into its even and odd byte with a mask and a shift, so this
// order saves a shuffle per 32 weights.
struct Int16Activations {
  int64_t cols = 0;
  std::vector<int16_t> code;  // 2 * cols
  std::vector<float> scale;   // per block of 32: its group's max|x| / 32767 (0 for an all-zero group)
  std::vector<float> sum;     // per block of 32: the fp32 sum of x
};
// cols must be a multiple of 32 (throws Error otherwise).
void quantize_activations_i16(const float* x, int64_t cols, Int16Activations& out);
// The same with the code of `level` (portable below Avx2): the same codes
// and scales at every level, the sums equal up to the order of the adds.
void quantize_activations_i16_at(CpuLevel level, const float* x, int64_t cols, Int16Activations& out);
// The high (low) code of column c (undoing the layout).
inline int16_t i16_code_at(const Int16Activations& a, int64_t c, bool low = false) {
  const int64_t i = c % 32;
  return a.code[size_t(2 * (c - i) + (low ? 32 : 0) + (i % 2) * 16 + i / 2)];
}

// Whether block_dot_row_i16_at runs for kind q at `level`: Q4_K, Q6_K, Q8_0
// and Q5_0 (the kinds of the Q4_K_M and Q8_0 files' decode) at the AVX2
// level and above.
bool block_dot_i16_supported(CpuLevel level, QuantKind q);
// dot(W[r, :], x) for W of a supported kind against x's codes
// (x.cols == W.cols; throws Error otherwise).
float block_dot_row_i16_at(CpuLevel level, const Matrix& W, int64_t r, const Int16Activations& x);
// y[r] = dot(W[r, :], x) for r in [r0, r1).
void block_dot_rows_i16_at(CpuLevel level, const Matrix& W, int64_t r0, int64_t r1, const Int16Activations& x,
                           float* y);

}  // namespace flashmoe::cpu
