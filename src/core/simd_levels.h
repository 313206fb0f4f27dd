// The per-level kernel tables behind core/simd.h, each defined in the
// translation unit that holds that level's code (simd.cpp: portable and AVX2;
// simd_avx512.cpp: AVX-512). Internal to core/.
#pragma once
#include "core/simd.h"

namespace flashmoe::cpu::simd {

extern const Kernels kPortableKernels;
#if defined(__x86_64__) || defined(__i386__)
extern const Kernels kAvx2Kernels;
extern const Kernels kAvx512Kernels;
#endif

// The portable scalar read of element i of a float-typed row (throws Error
// for other types): the tails of the vector kernels use it.
float scalar_at(DType t, const void* p, int64_t i);

// dot_panel_f32 from a level's own tile, 4-row and 1-row kernels (the
// portable level): the 4 x 4 tiles, then the leftover tokens four rows at a
// time, then the leftover rows one at a time.
template <auto Tile, auto Dot4, auto Dot>
void dot_panel_by_tiles(const float* a, int64_t lda, int64_t rows, const float* x, int64_t ldx, int64_t tokens,
                        int64_t n, float* y, int64_t ldy) {
  const int64_t rq = rows / 4 * 4, tq = tokens / 4 * 4;
  for (int64_t t = 0; t < tq; t += 4)
    for (int64_t r = 0; r < rq; r += 4) {
      float out[16];
      Tile(a + r * lda, lda, x + t * ldx, ldx, n, out);
      for (int k = 0; k < 4; ++k)
        for (int j = 0; j < 4; ++j) y[(t + j) * ldy + r + k] = out[4 * k + j];
    }
  for (int64_t t = tq; t < tokens; ++t)
    for (int64_t r = 0; r < rq; r += 4) {
      float out[4];
      Dot4(DType::F32, a + r * lda, size_t(lda) * sizeof(float), x + t * ldx, n, out);
      for (int k = 0; k < 4; ++k) y[t * ldy + r + k] = out[k];
    }
  for (int64_t r = rq; r < rows; ++r)
    for (int64_t t = 0; t < tokens; ++t) y[t * ldy + r] = Dot(DType::F32, a + r * lda, x + t * ldx, n);
}

// dot4xn_mixed from a level's 4-row kernel, a token at a time (the
// portable level).
template <auto Dot4>
void dot4xn_by_tokens(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t tokens, int64_t n,
                      float* y, int64_t ldy) {
  for (int64_t j = 0; j < tokens; ++j) {
    float out[4];
    Dot4(t, w, stride, x + j * ldx, n, out);
    for (int k = 0; k < 4; ++k) y[j * ldy + k] = out[k];
  }
}

// silu_mul, silu and sigmoid_mul with std::exp (the portable and avx2
// levels, and the avx512 kernels' tails).
void silu_mul_scalar(float* g, const float* u, int64_t n);
void silu_scalar(float* x, int64_t n);
void sigmoid_mul_scalar(float* y, const float* g, int64_t n);
// conv4_token channel by channel (the portable and avx2 levels, and the
// avx512 kernel's tail). Never inlined: inside an avx512 function the
// compiler could fuse its multiply-adds, and the bits would differ.
[[gnu::noinline]] void conv4_token_scalar(const float* taps, float* state, const float* u, int64_t n, float* y);

}  // namespace flashmoe::cpu::simd
