#include "backend/cpu/matmul.h"

#include <algorithm>
#include <vector>

#include "core/block_quant_i16.h"
#include "core/error.h"
#include "core/matrix_rows.h"
#include "core/simd.h"

namespace flashmoe::cpu {

namespace {

// Rows [r0, r1) against n token vectors. For a single token a row is read
// straight from its storage type; for several, blocks of rows are widened
// once to fp32 and reused across the tokens.
void rows_kernel(const Matrix& W, int64_t r0, int64_t r1, const float* x, int64_t n, int64_t ldx,
                 float* y, int64_t ldy, std::vector<float>& buf, const Int16Activations* xq) {
  if (xq) {
    // One token against Q4_K / Q6_K / Q8_0 rows: integer products with the
    // activations rounded to int16 once per call (core/block_quant_i16.h).
    block_dot_rows_i16_at(cpu_level(), W, r0, r1, *xq, y);
    return;
  }
  if (n == 1 && W.quantized()) {
    // fp32 activations against the stored codes, also at the avx512vnni
    // level: its int8 products (quant_dot_row_int8_at) gained 0-8% on the
    // memory-bound 35B shape and nothing on coder-mini, and rounding the
    // activations to int8 made the CPU's greedy ids part from the GPU's
    // (bench/NOTES.md, "int8 activations").
    for (int64_t r = r0; r < r1; ++r) y[r] = quant_dot_row(W, r, x);
    return;
  }
  if (n == 1) {
    const size_t rb = W.row_bytes();
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4)
      simd::dot4_mixed(W.dtype, static_cast<const uint8_t*>(W.data) + size_t(r) * rb, rb, x, W.cols, y + r);
    for (; r < r1; ++r) {
      const uint8_t* row = static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes();
      y[r] = simd::dot_mixed(W.dtype, row, x, W.cols);
    }
    return;
  }
  // Several tokens: a blocked product. A block of up to 16 rows is widened to
  // fp32 once (it stays in L2), then every group of 4 tokens meets each 4-row
  // slice of it in the 4 x 4 register tile (simd::dot4x4_f32): the 4 token
  // rows stay in L1 across the block's slices.
  const int64_t K = W.cols;
  constexpr int64_t kBlockRows = 16;
  buf.resize(size_t(K) * kBlockRows);
  for (int64_t rb = r0; rb < r1; rb += kBlockRows) {
    const int64_t re = std::min(r1, rb + kBlockRows);
    for (int64_t r = rb; r < re; ++r) load_row(W, r, buf.data() + (r - rb) * K);
    const int64_t quads_end = rb + (re - rb) / 4 * 4;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      const float* xt = x + t * ldx;
      for (int64_t r = rb; r < quads_end; r += 4) {
        float out[16];
        simd::dot4x4_f32(buf.data() + (r - rb) * K, K, xt, ldx, K, out);
        for (int k = 0; k < 4; ++k)
          for (int j = 0; j < 4; ++j) y[(t + j) * ldy + r + k] = out[4 * k + j];
      }
    }
    for (; t < n; ++t)
      for (int64_t r = rb; r < quads_end; r += 4) {
        float out[4];
        simd::dot4_f32(buf.data() + (r - rb) * K, K, x + t * ldx, K, out);
        for (int k = 0; k < 4; ++k) y[t * ldy + r + k] = out[k];
      }
    for (int64_t r = quads_end; r < re; ++r)
      for (int64_t tt = 0; tt < n; ++tt) y[tt * ldy + r] = simd::dot_f32(buf.data() + (r - rb) * K, x + tt * ldx, K);
  }
}

// x's int16 codes in `store` when W is one token's product that has an
// int16 kernel at this CPU level, else nullptr.
const Int16Activations* int16_activations(const Matrix& W, const float* x, int64_t n, Int16Activations& store) {
  if (n != 1 || !block_dot_i16_supported(cpu_level(), W.quant)) return nullptr;
  quantize_activations_i16(x, W.cols, store);
  return &store;
}

}  // namespace

void matmul_serial(const Matrix& W, const float* x, int64_t n, int64_t ldx, float* y, int64_t ldy) {
  thread_local std::vector<float> buf;
  thread_local Int16Activations xq;
  rows_kernel(W, 0, W.rows, x, n, ldx, y, ldy, buf, int16_activations(W, x, n, xq));
}

void matmul(ThreadPool& pool, const Matrix& W, const float* x, int64_t n, int64_t ldx, float* y,
            int64_t ldy) {
  if (n <= 0 || W.rows == 0) return;
  // Below ~32k multiply-adds a parallel region costs more than it saves.
  int64_t work = W.rows * W.cols * n;
  if (work < (1 << 15) || pool.size() == 1) {
    matmul_serial(W, x, n, ldx, y, ldy);
    return;
  }
  int64_t grain = std::max<int64_t>(4, (1 << 14) / std::max<int64_t>(1, W.cols * n));
  grain = (grain + 3) / 4 * 4;
  thread_local Int16Activations xq_store;
  const Int16Activations* xq = int16_activations(W, x, n, xq_store);
  pool.parallel_for(W.rows, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> buf;
    rows_kernel(W, r0, r1, x, n, ldx, y, ldy, buf, xq);
  }, grain);
}

}  // namespace flashmoe::cpu

namespace flashmoe::cpu {
float simd_dot_row(const Matrix& W, int64_t r, const float* x) {
  if (W.quantized()) return quant_dot_row(W, r, x);
  return simd::dot_mixed(W.dtype, static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes(), x, W.cols);
}
}  // namespace flashmoe::cpu
