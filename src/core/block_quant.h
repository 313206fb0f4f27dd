// Products and row reads over weights in ggml's block formats (the GGUF
// kinds of QuantKind): each row is a run of blocks of 32 or 256 weights that
// carry their own scales. The weights are read in that form, a block at a
// time, and multiplied against fp32 activations; the values a block stands
// for are exactly ggml's dequantisation of it (ggml-common.h layouts):
//
//   Q8_0   (32, 34 B): f16 d, int8 q[32];                w = d*q
//   Q4_0   (32, 18 B): f16 d, nibbles q[32];             w = d*(q-8)
//   Q4_1   (32, 20 B): f16 d, f16 m, nibbles;            w = d*q + m
//   Q5_0   (32, 22 B): f16 d, u32 high bits, nibbles;    w = d*(q-16)
//   Q5_1   (32, 24 B): f16 d, f16 m, u32 high bits, nibbles; w = d*q + m
//   IQ4_NL (32, 18 B): f16 d, nibbles indexing a 16-value table; w = d*T[q]
//   Q4_K  (256, 144 B): f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, nibbles
//   Q5_K  (256, 176 B): as Q4_K plus 32 bytes of fifth bits
//   Q6_K  (256, 210 B): 4 low bits x 256, 2 high bits x 256, int8 scale x 16, f16 d
//   IQ4_XS(256, 136 B): f16 d, 6-bit scales x 8 (low nibbles + high pairs), nibbles into T
//
// In a block of 32 nibbles, byte j holds weight j (low) and weight j+16 (high).
#pragma once
#include <cstdint>

#include "core/cpu_features.h"
#include "core/matrix.h"

namespace flashmoe::cpu {

// Weights of one block (block_elems(q) floats), the portable reference.
void block_dequant(QuantKind q, const uint8_t* block, float* out);

// Row r of a block-quantised W as fp32 (W.cols floats).
void block_dequant_row(const Matrix& W, int64_t r, float* out);
// dot(W[r, :], x) for a block-quantised W, with the kernels of `level`
// (portable below Avx2).
float block_dot_row_at(CpuLevel level, const Matrix& W, int64_t r, const float* x);
float block_dot_row(const Matrix& W, int64_t r, const float* x);

}  // namespace flashmoe::cpu
