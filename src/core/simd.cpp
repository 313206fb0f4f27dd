#include "core/simd.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FLASHMOE_X86 1
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#endif

#include "core/error.h"
#include "core/simd_levels.h"

namespace flashmoe::cpu::simd {

float scalar_at(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: fail(std::string("weights of dtype ") + dtype_name(t) + " are not supported by the CPU kernels");
  }
}

// ---- portable reference versions ----
namespace {

void to_f32_generic(DType t, const void* src, int64_t n, float* out) {
  if (t == DType::F32) {
    std::memcpy(out, src, size_t(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = scalar_at(t, src, i);
}

float dot_mixed_generic(DType t, const void* w, const float* x, int64_t n) {
  float acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] += scalar_at(t, w, i + k) * x[i + k];
  for (; i < n; ++i) acc[0] += scalar_at(t, w, i) * x[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

float dot_f32_generic(const float* a, const float* b, int64_t n) {
  float acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] += a[i + k] * b[i + k];
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

void dot4_mixed_generic(DType t, const void* w, size_t stride, const float* x, int64_t n, float out[4]) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  for (int k = 0; k < 4; ++k) out[k] = dot_mixed_generic(t, base + k * stride, x, n);
}

void dot4x4_f32_generic(const float* a, int64_t lda, const float* x, int64_t ldx, int64_t n, float out[16]) {
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 4; ++j) out[4 * k + j] = dot_f32_generic(a + k * lda, x + j * ldx, n);
}

void axpy_generic(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

void silu_mul_scalar(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void silu_scalar(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.0f + std::exp(-x[i]));
}

void sigmoid_mul_scalar(float* y, const float* g, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= 1.0f / (1.0f + std::exp(-g[i]));
}

void conv4_token_scalar(const float* taps, float* state, const float* u, int64_t n, float* y) {
  for (int64_t c = 0; c < n; ++c) {
    const float* t = taps + c * 4;
    float* s = state + c * 3;
    float acc = t[3] * u[c];
    acc += t[0] * s[0];
    acc += t[1] * s[1];
    acc += t[2] * s[2];
    s[0] = s[1];
    s[1] = s[2];
    s[2] = u[c];
    y[c] = acc;
  }
}

const Kernels kPortableKernels = {
    to_f32_generic, dot_mixed_generic, dot4_mixed_generic, dot4xn_by_tokens<dot4_mixed_generic>,
    dot_panel_by_tiles<dot4x4_f32_generic, dot4_mixed_generic, dot_mixed_generic>, axpy_generic, silu_mul_scalar,
    silu_scalar, sigmoid_mul_scalar, conv4_token_scalar, 3};

#ifdef FLASHMOE_X86
namespace {

AVX2_FN inline __m256 load8(DType t, const void* p, int64_t i) {
  if (t == DType::BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (t == DType::F16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_cvtph_ps(h);
  }
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

AVX2_FN void to_f32_avx2(DType t, const void* src, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(t, src, i));
  for (; i < n; ++i) out[i] = scalar_at(t, src, i);
}

// Every dot product here uses the same arithmetic per row: one 8-lane
// accumulator filled in index order, reduced as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)),
// then the scalar tail. So a row gives bit-identical results whether it is
// computed alone, in a group of four, from bf16 or from its fp32 widening:
// prefill (rows widened once, many tokens) and decode (one token) agree
// exactly, which FP8 KV storage needs (a last-bit change in K can flip an
// FP8 rounding).
AVX2_FN inline float hsum_canonical(__m256 v) {
  __m256 a = _mm256_hadd_ps(v, v);  // [l0+l1, l2+l3, ., ., l4+l5, l6+l7, ., .]
  a = _mm256_hadd_ps(a, a);         // [(l0+l1)+(l2+l3), ., ., ., (l4+l5)+(l6+l7), ...]
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
}

AVX2_FN float dot_mixed_avx2(DType t, const void* w, const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load8(t, w, i), _mm256_loadu_ps(x + i), acc);
  float s = hsum_canonical(acc);
  for (; i < n; ++i) s += scalar_at(t, w, i) * x[i];
  return s;
}

// Four rows against N tokens (N <= 3: 4N accumulators, N token vectors and
// one row vector fill the 16 registers): each step of a row is loaded and
// widened once for all N tokens; per row and token one 8-lane accumulator
// filled in index order, the four rows' horizontal sums at once, then the
// scalar tail, so a token's outputs do not depend on the tile it is in.
// y[j * ldy + k]: row k, token j.
template <int N>
AVX2_FN inline void dot4xn_tile_avx2(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t n,
                                     float* y, int64_t ldy) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const void* r[4] = {base, base + stride, base + 2 * stride, base + 3 * stride};
  __m256 s[N][4];
  for (int j = 0; j < N; ++j)
    for (int k = 0; k < 4; ++k) s[j][k] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 xv[N];
    for (int j = 0; j < N; ++j) xv[j] = _mm256_loadu_ps(x + j * ldx + i);
    for (int k = 0; k < 4; ++k) {
      const __m256 wv = load8(t, r[k], i);
      for (int j = 0; j < N; ++j) s[j][k] = _mm256_fmadd_ps(wv, xv[j], s[j][k]);
    }
  }
  for (int j = 0; j < N; ++j) {
    float* out = y + j * ldy;
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[j][0], s[j][1]), _mm256_hadd_ps(s[j][2], s[j][3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
    const float* xj = x + j * ldx;
    for (int64_t c = i; c < n; ++c)
      for (int k = 0; k < 4; ++k) out[k] += scalar_at(t, r[k], c) * xj[c];
  }
}

AVX2_FN void dot4_mixed_avx2(DType t, const void* w, size_t stride, const float* x, int64_t n, float out[4]) {
  dot4xn_tile_avx2<1>(t, w, stride, x, 0, n, out, 0);
}

AVX2_FN void dot4xn_mixed_avx2(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t tokens,
                               int64_t n, float* y, int64_t ldy) {
  int64_t j = 0;
  for (; j + 3 <= tokens; j += 3) dot4xn_tile_avx2<3>(t, w, stride, x + j * ldx, ldx, n, y + j * ldy, ldy);
  if (tokens - j == 2) dot4xn_tile_avx2<2>(t, w, stride, x + j * ldx, ldx, n, y + j * ldy, ldy);
  else if (tokens - j == 1) dot4xn_tile_avx2<1>(t, w, stride, x + j * ldx, ldx, n, y + j * ldy, ldy);
}

// The prefill's panel: four fp32 rows at a time against every token (in
// dot4xn_mixed_avx2's tiles of three; the 4 x 4 tiles of dot_panel_by_tiles
// would each be a tile of three and a lone token), then the leftover rows
// one at a time.
AVX2_FN void dot_panel_f32_avx2(const float* a, int64_t lda, int64_t rows, const float* x, int64_t ldx, int64_t tokens,
                                int64_t n, float* y, int64_t ldy) {
  const int64_t rq = rows / 4 * 4;
  for (int64_t r = 0; r < rq; r += 4)
    dot4xn_mixed_avx2(DType::F32, a + r * lda, size_t(lda) * sizeof(float), x, ldx, tokens, n, y + r, ldy);
  for (int64_t r = rq; r < rows; ++r)
    for (int64_t j = 0; j < tokens; ++j) y[j * ldy + r] = dot_mixed_avx2(DType::F32, a + r * lda, x + j * ldx, n);
}

AVX2_FN void axpy_avx2(float alpha, const float* x, float* y, int64_t n) {
  __m256 av = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// exp(x) on 8 lanes: avx512's exp16 (core/simd_avx512.cpp), the same
// reduction and polynomial in the same order; its scalef by 2^n done as
// two power-of-two products (each factor a normal float for n in [-150,
// 128]; the first is exact, the second rounds only a subnormal result).
// kv_kernels' exp_avx2 is the softmax's, for x <= 0 only; a gate's
// argument takes either sign.
AVX2_FN inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

AVX2_FN void silu_mul_avx2(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  silu_mul_scalar(g + i, u + i, n - i);
}

AVX2_FN void silu_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
  }
  silu_scalar(x + i, n - i);
}

AVX2_FN void sigmoid_mul_avx2(float* y, const float* g, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(g + i)));
    const __m256 s = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), s));
  }
  sigmoid_mul_scalar(y + i, g + i, n - i);
}

}  // namespace

const Kernels kAvx2Kernels = {to_f32_avx2,
                              dot_mixed_avx2,
                              dot4_mixed_avx2,
                              dot4xn_mixed_avx2,
                              dot_panel_f32_avx2,
                              axpy_avx2,
                              silu_mul_avx2,
                              silu_avx2,
                              sigmoid_mul_avx2,
                              conv4_token_scalar,
                              16};
#endif

const Kernels& kernels(CpuLevel level) {
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx512) return kAvx512Kernels;
  if (level == CpuLevel::Avx2) return kAvx2Kernels;
#endif
  return kPortableKernels;
}

namespace {

// The level's kernels for the types they handle, else the portable code
// (which names an unsupported type in its error).
const Kernels& for_type(DType t) {
  static const Kernels& k = kernels(cpu_level());
  return t == DType::BF16 || t == DType::F16 || t == DType::F32 ? k : kPortableKernels;
}

const Kernels& active() {
  static const Kernels& k = kernels(cpu_level());
  return k;
}

}  // namespace

void to_f32(DType t, const void* src, int64_t n, float* out) { for_type(t).to_f32(t, src, n, out); }

float dot_mixed(DType t, const void* w, const float* x, int64_t n) { return for_type(t).dot_mixed(t, w, x, n); }

float dot_f32(const float* a, const float* b, int64_t n) { return active().dot_mixed(DType::F32, a, b, n); }

void dot4_mixed(DType t, const void* w, size_t stride, const float* x, int64_t n, float out[4]) {
  for_type(t).dot4_mixed(t, w, stride, x, n, out);
}

void dot4xn_mixed(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t tokens, int64_t n,
                  float* y, int64_t ldy) {
  for_type(t).dot4xn_mixed(t, w, stride, x, ldx, tokens, n, y, ldy);
}

int64_t stored_row_tokens(DType t) { return for_type(t).stored_row_tokens; }

void dot4_f32(const float* a, int64_t lda, const float* x, int64_t n, float out[4]) {
  active().dot4_mixed(DType::F32, a, size_t(lda) * sizeof(float), x, n, out);
}

void dot_panel_f32(const float* a, int64_t lda, int64_t rows, const float* x, int64_t ldx, int64_t tokens, int64_t n,
                   float* y, int64_t ldy) {
  active().dot_panel_f32(a, lda, rows, x, ldx, tokens, n, y, ldy);
}

void axpy(float alpha, const float* x, float* y, int64_t n) { active().axpy(alpha, x, y, n); }

void silu_mul(float* g, const float* u, int64_t n) { active().silu_mul(g, u, n); }
void silu(float* x, int64_t n) { active().silu(x, n); }
void sigmoid_mul(float* y, const float* g, int64_t n) { active().sigmoid_mul(y, g, n); }
void conv4_token(const float* taps, float* state, const float* u, int64_t n, float* y) {
  active().conv4_token(taps, state, u, n, y);
}

}  // namespace flashmoe::cpu::simd
