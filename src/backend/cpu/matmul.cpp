#include "backend/cpu/matmul.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/matrix_rows.h"
#include "core/simd.h"

namespace flashmoe::cpu {

bool cpu_has_avx2() { return simd::has_avx2(); }

namespace {

// One output row against n token vectors. For a single token the row is read
// straight from its storage type; for several it is widened once to fp32 and
// reused across the tokens.
void rows_kernel(const Matrix& W, int64_t r0, int64_t r1, const float* x, int64_t n, int64_t ldx,
                 float* y, int64_t ldy, std::vector<float>& buf) {
  if (n == 1 && W.quantized()) {
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
  buf.resize(size_t(W.cols) * 4);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    for (int k = 0; k < 4; ++k) load_row(W, r + k, buf.data() + k * W.cols);
    for (int64_t t = 0; t < n; ++t) {
      float out[4];
      simd::dot4_f32(buf.data(), W.cols, x + t * ldx, W.cols, out);
      for (int k = 0; k < 4; ++k) y[t * ldy + r + k] = out[k];
    }
  }
  for (; r < r1; ++r) {
    load_row(W, r, buf.data());
    for (int64_t t = 0; t < n; ++t) y[t * ldy + r] = simd::dot_f32(buf.data(), x + t * ldx, W.cols);
  }
}

}  // namespace

void matmul_serial(const Matrix& W, const float* x, int64_t n, int64_t ldx, float* y, int64_t ldy) {
  thread_local std::vector<float> buf;
  rows_kernel(W, 0, W.rows, x, n, ldx, y, ldy, buf);
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
  pool.parallel_for(W.rows, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> buf;
    rows_kernel(W, r0, r1, x, n, ldx, y, ldy, buf);
  }, grain);
}

}  // namespace flashmoe::cpu

namespace flashmoe::cpu {
float simd_dot_row(const Matrix& W, int64_t r, const float* x) {
  if (W.quantized()) return quant_dot_row(W, r, x);
  return simd::dot_mixed(W.dtype, static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes(), x, W.cols);
}
}  // namespace flashmoe::cpu
