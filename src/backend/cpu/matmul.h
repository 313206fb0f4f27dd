// Matrix products over weights in their storage format (bf16, f16, f32),
// computed in fp32. The weight is read once per call: for one token that is
// the whole cost of decoding, so it is the loop to keep fast.
#pragma once
#include <cstdint>

#include "core/matrix.h"
#include "core/matrix_rows.h"  // load_row
#include "core/thread_pool.h"

namespace flashmoe::cpu {

// y[t, r] = sum_c W[r, c] * x[t, c] for t in [0, n). x is [n, W.cols] with
// row stride ldx, y is [n, W.rows] with row stride ldy.
void matmul(ThreadPool& pool, const Matrix& W, const float* x, int64_t n, int64_t ldx, float* y,
            int64_t ldy);

inline void matmul(ThreadPool& pool, const Matrix& W, const float* x, int64_t n, float* y) {
  matmul(pool, W, x, n, W.cols, y, W.rows);
}

// One product of a group sharing its input (see matmuls).
struct Product {
  const Matrix* W;
  float* y;          // [n, W->rows], row stride ldy
  int64_t ldy = 0;   // 0: W->rows
};

// y_i = W_i x for every product of the group, all of x's columns (the same
// for each W_i; row stride ldx, 0: that width), in one parallel region over
// their rows together: a layer's projections of a decode step are products
// of a few microseconds, each of which was a region of its own
// (bench/NOTES.md, "Session 23"). matmul is a group of one. Each row's bits
// do not depend on the group or the split.
void matmuls(ThreadPool& pool, const Product* products, size_t count, const float* x, int64_t n, int64_t ldx = 0);

// Same product on the calling thread only (for use inside parallel regions).
void matmul_serial(const Matrix& W, const float* x, int64_t n, int64_t ldx, float* y, int64_t ldy);

}  // namespace flashmoe::cpu

namespace flashmoe::cpu {
// dot(W[r, :], x) in fp32.
float simd_dot_row(const Matrix& W, int64_t r, const float* x);
}  // namespace flashmoe::cpu
