// Vector kernels, one set per instruction level (core/cpu_features.h): the
// widest the CPU has is chosen at run time, so one binary runs on any x86-64
// (and builds elsewhere). The free functions use cpu_level()'s set;
// kernels(level) gives any set the CPU supports (the tests run each).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/cpu_features.h"
#include "core/dtype.h"

namespace flashmoe::cpu::simd {

// One level's kernels. Within a level every dot product of a row of n values
// uses the same arithmetic whether it is computed alone, four rows at a time,
// in a 4 x 4 tile, from bf16 / f16 or from its exact fp32 widening: prefill
// (rows widened once, many tokens) and decode (one token) agree bit for bit,
// which FP8 KV storage needs (a last-bit change in K can flip an FP8
// rounding). Weight types: BF16, F16, F32.
struct Kernels {
  // Widens n elements of type t to fp32 (exact).
  void (*to_f32)(DType t, const void* src, int64_t n, float* out);
  // sum_i w[i] * x[i] where w is stored as type t.
  float (*dot_mixed)(DType t, const void* w, const float* x, int64_t n);
  // out[k] = dot(row k, x) for 4 rows of type t, `stride` bytes apart: x is
  // loaded once for all four, the decode matvec's inner loop.
  void (*dot4_mixed)(DType t, const void* w, size_t stride, const float* x, int64_t n, float out[4]);
  // y[j * ldy + k] = dot(row k, x + j * ldx) for those 4 rows and tokens
  // j < tokens: each step of the rows widened once for every tile of up to
  // four tokens (a product of a few tokens, such as a routed expert picked
  // by a few of a batched step's tokens, which dot4_mixed widened once per
  // token). Each output has dot4_mixed's bits for its token.
  void (*dot4xn_mixed)(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t tokens, int64_t n,
                       float* y, int64_t ldy);
  // y[t * ldy + r] = dot(a + r*lda, x + t*ldx) for rows r < rows and tokens
  // t < tokens: the prefill's whole block of fp32 rows against every token,
  // tiled 4 x 4 inside (no call, spill or scatter per tile). Every output
  // has the bits of dot_mixed(F32, ...) of its row and token.
  void (*dot_panel_f32)(const float* a, int64_t lda, int64_t rows, const float* x, int64_t ldx, int64_t tokens,
                        int64_t n, float* y, int64_t ldy);
  // y += alpha * x
  void (*axpy)(float alpha, const float* x, float* y, int64_t n);
  // g[i] = silu(g[i]) * u[i], silu(x) = x / (1 + exp(-x)): the SwiGLU
  // gate. Portable and avx2 call std::exp; avx512 has a vector exp (Cephes'
  // polynomial, within 2 ulp of std::exp).
  void (*silu_mul)(float* g, const float* u, int64_t n);
  // x[i] = silu(x[i]) (the GatedDeltaNet's conv output and gated norm), and
  // y[i] *= sigmoid(g[i]) = 1 / (1 + exp(-g[i])) (gated attention's output
  // gate); the same exp as silu_mul at each level. A batched decode step
  // takes thousands a layer (coder-mini at 8 sequences: 4,096 in a
  // GatedDeltaNet's conv, 2,048 in its gated norm, 4,096 in an attention
  // gate), a scalar exp and divide each before (bench/NOTES.md, "Session 24").
  void (*silu)(float* x, int64_t n);
  void (*sigmoid_mul)(float* y, const float* g, int64_t n);
  // One token of a causal depthwise conv of kernel 4 over n channels (the
  // GatedDeltaNet's decode step): taps [n][4], state [n][3] (the channel's
  // last three inputs, oldest first), input u[n]. y[c] = taps[c][3] * u[c],
  // then + taps[c][j] * state[c][j] for j = 0, 1, 2, each product and sum
  // rounded on its own (no fused multiply-add: the prompt path's order and
  // bits); then state[c] = {state[c][1], state[c][2], u[c]}. The portable
  // and avx2 levels go channel by channel; avx512 16 channels at a time.
  void (*conv4_token)(const float* taps, float* state, const float* u, int64_t n, float* y);
  // The most tokens for which a product runs dot4xn_mixed on the stored
  // rows; more widen blocks of rows to fp32 once for dot_panel_f32.
  // Measured per level: avx512's tiles of up to 4 tokens and avx2's of up
  // to 3 beat the widening up to 16 tokens (bench/NOTES.md, "Session 23"
  // and "Session 26"); portable runs dot4xn_mixed a token at a time, so 3.
  int64_t stored_row_tokens;
};

// The kernels of `level` (which must be <= cpu_level_supported()).
const Kernels& kernels(CpuLevel level);

// The free functions below: kernels(cpu_level()), with the types the vector
// paths lack (none today but the quantised ones, which core/matrix_rows
// handles) sent to the portable code.
void to_f32(DType t, const void* src, int64_t n, float* out);
float dot_mixed(DType t, const void* w, const float* x, int64_t n);
float dot_f32(const float* a, const float* b, int64_t n);
void dot4_mixed(DType t, const void* w, size_t stride, const float* x, int64_t n, float out[4]);
void dot4xn_mixed(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t tokens, int64_t n,
                  float* y, int64_t ldy);
void dot4_f32(const float* a, int64_t lda, const float* x, int64_t n, float out[4]);
void dot_panel_f32(const float* a, int64_t lda, int64_t rows, const float* x, int64_t ldx, int64_t tokens, int64_t n,
                   float* y, int64_t ldy);
void axpy(float alpha, const float* x, float* y, int64_t n);
void silu_mul(float* g, const float* u, int64_t n);
void silu(float* x, int64_t n);
void sigmoid_mul(float* y, const float* g, int64_t n);
void conv4_token(const float* taps, float* state, const float* u, int64_t n, float* y);
// Kernels::stored_row_tokens of the level that multiplies rows of type t.
int64_t stored_row_tokens(DType t);

}  // namespace flashmoe::cpu::simd
