#include "backend/cpu/matmul.h"

#include <algorithm>
#include <vector>

#include "core/block_quant_i16.h"
#include "core/aligned.h"
#include "core/error.h"
#include "core/matrix_rows.h"
#include "core/simd.h"

namespace flashmoe::cpu {

namespace {

// How far ahead of the rows being multiplied their successors are
// prefetched on the stored-rows path (4 KB measured best of 2, 4 and 8 KB
// on coder-mini).
constexpr size_t kPrefetchAhead = 4096;

// Rows [r0, r1) against n token vectors. For a single token a row is read
// straight from its storage type; for several, blocks of rows are widened
// once to fp32 and reused across the tokens.
void rows_kernel(const Matrix& W, int64_t r0, int64_t r1, const float* x, int64_t n, int64_t ldx,
                 float* y, int64_t ldy, AlignedFloats& buf, const Int16Activations* xq) {
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
  // A few tokens of a bf16 / f16 / f32 matrix (up to the level's
  // simd::stored_row_tokens: 16 at avx2 and avx512, 3 at portable): four
  // stored rows at a time against every token, each step of the rows
  // converted in registers once per tile of tokens (simd::dot4xn_mixed).
  // Widening a block of rows pays when many tokens reuse it; for a few the
  // widening (a store and a reload of every weight) cost more than
  // converting in registers: the batched step's routed experts, each picked
  // by 1-3 of the step's tokens, and its dense products up to 16
  // sequences. The same bits either way (simd.h: a row's product from its
  // storage type or from its exact fp32 widening).
  if (!W.quantized() && n <= simd::stored_row_tokens(W.dtype)) {
    const size_t rb = W.row_bytes();
    const uint8_t* rows = static_cast<const uint8_t*>(W.data);
    int64_t r = r0;
    // The rows kPrefetchAhead bytes on are asked for while these four are
    // multiplied: a decode step's products and a batched step's routed
    // experts are matrices read once per step, and their rows waited on memory
    // (bench/NOTES.md, "Session 23": B = 8 +11%, B = 1 +3-20%).
    const size_t end = size_t(r1) * rb;
    for (; r + 4 <= r1; r += 4) {
      const size_t at = size_t(r) * rb, stop = std::min(end, at + kPrefetchAhead + 4 * rb);
      for (size_t o = at + kPrefetchAhead; o < stop; o += 64) __builtin_prefetch(rows + o);
      simd::dot4xn_mixed(W.dtype, rows + at, rb, x, ldx, n, W.cols, y + r, ldy);
    }
    for (; r < r1; ++r)
      for (int64_t t = 0; t < n; ++t) y[t * ldy + r] = simd::dot_mixed(W.dtype, rows + size_t(r) * rb, x + t * ldx, W.cols);
    return;
  }
  // Several tokens: a blocked product. A block of rows is widened to fp32
  // once (it stays in L1, and starts a cache line as the callers' token
  // rows do), then the panel kernel (simd::dot_panel_f32) meets it with
  // every token in 4 x 4 register tiles, each output written in place.
  const int64_t K = W.cols;
  constexpr int64_t kBlockRows = 16;
  buf.resize(size_t(K) * kBlockRows);
  for (int64_t rb = r0; rb < r1; rb += kBlockRows) {
    const int64_t re = std::min(r1, rb + kBlockRows);
    for (int64_t r = rb; r < re; ++r) load_row(W, r, buf.data() + (r - rb) * K);
    // The next block's stored rows are asked for now, so that they arrive
    // while this block's panel runs (widening waited on memory: the experts'
    // weights are read once per prompt chunk).
    const int64_t next_end = std::min(r1, re + kBlockRows);
    if (re < next_end) {
      const char* from = static_cast<const char*>(W.data) + size_t(re) * W.row_bytes();
      const size_t bytes = size_t(next_end - re) * W.row_bytes();
      for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(from + off);
    }
    simd::dot_panel_f32(buf.data(), K, re - rb, x, ldx, n, K, y + rb, ldy);
  }
}

// x's int16 codes in `store` when W is one token's product that has an
// int16 kernel at this CPU level, else nullptr.
const Int16Activations* int16_activations(const Matrix& W, const float* x, int64_t n, Int16Activations& store) {
  if (n != 1 || !block_dot_i16_supported(cpu_level(), W.quant)) return nullptr;
  quantize_activations_i16(x, W.cols, store);
  return &store;
}

// Below ~32k multiply-adds a parallel region costs more than it saves.
constexpr int64_t kParallelWork = 1 << 15;

// A thread's share of the stored rows under which it takes it in two claims.
constexpr int64_t kFewClaimsBytes = 512 << 10;

// Rows per claim of a parallel product of `rows` rows (`bytes` stored):
// ~16k multiply-adds, whole tiles of 4; but two claims a thread where each
// thread's share is under kFewClaimsBytes. Each claim starts its rows'
// stream from memory cold (the prefetch runs ahead within a claim), and
// the pool deals claims in order, so a thread's next claim is seldom the
// rows after its last: a 784 x 256 bf16 product (400 KB) took 18.6 us on
// two threads in 8 claims and 15.2 us in 2 at 8 tokens, 13.2 and 10.1 us
// at one token. In the step, one claim a thread lost (a thread that
// starts late leaves the other waiting) and two won: coder-mini B = 1
// +5%, B = 8 +7% (bench/NOTES.md, "Session 24"). Large products keep the
// finer claims, which balance the threads' finishing times.
int64_t row_grain(int64_t cols, int64_t n, int64_t rows, int64_t bytes, int threads) {
  int64_t grain = std::max<int64_t>(4, (1 << 14) / std::max<int64_t>(1, cols * n));
  if (bytes <= kFewClaimsBytes * threads) grain = std::max(grain, (rows + 2 * threads - 1) / (2 * threads));
  return (grain + 3) / 4 * 4;
}

}  // namespace

void matmul_serial(const Matrix& W, const float* x, int64_t n, int64_t ldx, float* y, int64_t ldy) {
  thread_local AlignedFloats buf;
  thread_local Int16Activations xq;
  rows_kernel(W, 0, W.rows, x, n, ldx, y, ldy, buf, int16_activations(W, x, n, xq));
}

void matmuls(ThreadPool& pool, const Product* products, size_t count, const float* x, int64_t n, int64_t ldx) {
  if (n <= 0 || count == 0) return;
  const int64_t K = products[0].W->cols;
  if (ldx == 0) ldx = K;
  int64_t rows = 0, bytes = 0;
  for (size_t i = 0; i < count; ++i) {
    if (products[i].W->cols != K) fail("matmuls: the products do not share their input width");
    rows += products[i].W->rows;
    bytes += products[i].W->rows * int64_t(products[i].W->row_bytes());
  }
  auto ldy = [&](size_t i) { return products[i].ldy ? products[i].ldy : products[i].W->rows; };
  if (rows * K * n < kParallelWork || pool.size() == 1) {
    for (size_t i = 0; i < count; ++i) matmul_serial(*products[i].W, x, n, ldx, products[i].y, ldy(i));
    return;
  }
  // Kept on this thread (one token's int16 codes per product, and pointers
  // to them). A reference, so that the workers read this thread's.
  thread_local std::vector<Int16Activations> xq_store;
  thread_local std::vector<const Int16Activations*> xq_kept;
  std::vector<const Int16Activations*>& xq = xq_kept;
  if (xq_store.size() < count) xq_store.resize(count);
  xq.resize(count);
  for (size_t i = 0; i < count; ++i) xq[i] = int16_activations(*products[i].W, x, n, xq_store[i]);
  // Claims are ranges of the products' rows laid end to end; a range that
  // spans two products runs as a piece of each.
  pool.parallel_for(rows, [&](int64_t r0, int64_t r1) {
    thread_local AlignedFloats buf;
    int64_t first = 0;
    for (size_t i = 0; i < count && r0 < r1; ++i) {
      const Matrix& W = *products[i].W;
      const int64_t lo = std::max(r0, first), hi = std::min(r1, first + W.rows);
      if (lo < hi) rows_kernel(W, lo - first, hi - first, x, n, ldx, products[i].y, ldy(i), buf, xq[i]);
      first += W.rows;
    }
  }, row_grain(K, n, rows, bytes, pool.size()));
}

void matmul(ThreadPool& pool, const Matrix& W, const float* x, int64_t n, int64_t ldx, float* y,
            int64_t ldy) {
  const Product p{&W, y, ldy};
  matmuls(pool, &p, 1, x, n, ldx);
}

}  // namespace flashmoe::cpu

namespace flashmoe::cpu {
float simd_dot_row(const Matrix& W, int64_t r, const float* x) {
  if (W.quantized()) return quant_dot_row(W, r, x);
  return simd::dot_mixed(W.dtype, static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes(), x, W.cols);
}
}  // namespace flashmoe::cpu
