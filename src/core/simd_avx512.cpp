// The AVX-512 level of core/simd.h: 16-lane fp32 kernels, each function
// compiled for AVX-512 F/BW/VL/DQ by its target attribute (not the whole file
// by a flag, so no inline function from a header is emitted here with
// AVX-512 code for the linker to pick for the other levels).
#include "core/simd_levels.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 intrinsics initialise their undefined-value operands as
// `__m512 __Y = __Y;`, which -Wuninitialized reports in every caller compiled
// by a target attribute (a false positive: the operand is masked off).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
// AVX512_FN, always inlined.
#define AVX512_INLINE_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), always_inline)) inline

namespace flashmoe::cpu::simd {

namespace {

// The lanes of [i, n) among [i, i + 16).
inline __mmask16 lanes(int64_t i, int64_t n) {
  return n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
}
constexpr __mmask16 kAll = 0xFFFF;

AVX512_FN inline __m512 loadx(const float* x, int64_t i, __mmask16 m) {
  if (m == kAll) return _mm512_loadu_ps(x + i);
  return _mm512_maskz_loadu_ps(m, x + i);
}

// Lanes [i, i + 16) of a row of type t as fp32; lanes outside m are 0
// (masked loads, so a row's tail is one more step of the same arithmetic).
AVX512_FN inline __m512 load16(DType t, const void* p, int64_t i, __mmask16 m) {
  if (t == DType::BF16) {
    const uint16_t* q = static_cast<const uint16_t*>(p) + i;
    __m256i h = m == kAll ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)) : _mm256_maskz_loadu_epi16(m, q);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if (t == DType::F16) {
    const uint16_t* q = static_cast<const uint16_t*>(p) + i;
    return _mm512_cvtph_ps(m == kAll ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
                                     : _mm256_maskz_loadu_epi16(m, q));
  }
  return loadx(static_cast<const float*>(p), i, m);
}


// The canonical reduction of one 16-lane accumulator, a fixed tree:
//   s_j = l_j + l_{j+8}, s'_j = s_j + s_{j+4}, s''_j = s'_j + s'_{j+2},
//   result = s''_0 + s''_1.
// reduce4 and the panel's tile (panel_tile) compute the same tree for 4 and
// 16 accumulators at once (with shuffles), so every kernel gives the same
// bits per row.
AVX512_FN inline float reduce1(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// Level 1 for two accumulators: quarters [x: s_0..3, x: s_4..7, y: s_0..3, y: s_4..7].
AVX512_FN inline __m512 level1(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
// Level 2 for two level-1 results (four accumulators a, b | c, d): quarter
// r holds s'_0..3 of accumulator r.
AVX512_FN inline __m512 level2(__m512 ab, __m512 cd) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}
// Level 3 for two level-2 results x, y: in each 128-bit lane
// [x0+x2, x1+x3, y0+y2, y1+y3].
AVX512_FN inline __m512 level3(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
// Level 4 for two level-3 results p, q: in each 128-bit lane
// [p0+p1, p2+p3, q0+q1, q2+q3].
AVX512_FN inline __m512 level4(__m512 p, __m512 q) {
  return _mm512_add_ps(_mm512_shuffle_ps(p, q, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[k] = reduce1(v[k]) for k in 0..3.
AVX512_FN inline void reduce4(const __m512 v[4], float out[4]) {
  const __m512 u = level2(level1(v[0], v[1]), level1(v[2], v[3]));  // quarter k: accumulator k
  // Levels 3 and 4 of u against itself: lane 0 of quarter k is the result.
  const __m512 w = level4(level3(u, u), level3(u, u));
  const __m512 picked = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w);
  _mm_storeu_ps(out, _mm512_castps512_ps128(picked));
}

AVX512_FN void to_f32_avx512(DType t, const void* src, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, load16(t, src, i, kAll));
  if (i < n) _mm512_mask_storeu_ps(out + i, lanes(i, n), load16(t, src, i, lanes(i, n)));
}

AVX512_FN float dot_mixed_avx512(DType t, const void* w, const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(load16(t, w, i, kAll), loadx(x, i, kAll), acc);
  if (i < n) acc = _mm512_fmadd_ps(load16(t, w, i, lanes(i, n)), loadx(x, i, lanes(i, n)), acc);
  return reduce1(acc);
}

AVX512_FN inline void dot4_step(DType t, const void* r0, const void* r1, const void* r2, const void* r3,
                                const float* x, int64_t i, __mmask16 m, __m512 s[4]) {
  const __m512 xv = loadx(x, i, m);
  s[0] = _mm512_fmadd_ps(load16(t, r0, i, m), xv, s[0]);
  s[1] = _mm512_fmadd_ps(load16(t, r1, i, m), xv, s[1]);
  s[2] = _mm512_fmadd_ps(load16(t, r2, i, m), xv, s[2]);
  s[3] = _mm512_fmadd_ps(load16(t, r3, i, m), xv, s[3]);
}

AVX512_FN void dot4_mixed_avx512(DType t, const void* w, size_t stride, const float* x, int64_t n, float out[4]) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const void* r0 = base;
  const void* r1 = base + stride;
  const void* r2 = base + 2 * stride;
  const void* r3 = base + 3 * stride;
  __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) dot4_step(t, r0, r1, r2, r3, x, i, kAll, s);
  if (i < n) dot4_step(t, r0, r1, r2, r3, x, i, lanes(i, n), s);
  reduce4(s, out);
}

// One 16-column step of 4 rows against N tokens: each row's lanes widened
// once, then dot4_step's multiply-add per token (the same operands, so the
// same bits per accumulator).
template <int N>
AVX512_INLINE_FN void dot4xn_step(DType t, const void* r0, const void* r1, const void* r2, const void* r3,
                                  const float* x, int64_t ldx, int64_t i, __mmask16 m, __m512 (&s)[N][4]) {
  const __m512 w0 = load16(t, r0, i, m), w1 = load16(t, r1, i, m), w2 = load16(t, r2, i, m),
               w3 = load16(t, r3, i, m);
  for (int j = 0; j < N; ++j) {
    const __m512 xv = loadx(x + j * ldx, i, m);
    s[j][0] = _mm512_fmadd_ps(w0, xv, s[j][0]);
    s[j][1] = _mm512_fmadd_ps(w1, xv, s[j][1]);
    s[j][2] = _mm512_fmadd_ps(w2, xv, s[j][2]);
    s[j][3] = _mm512_fmadd_ps(w3, xv, s[j][3]);
  }
}

template <int N>
AVX512_INLINE_FN void dot4xn_tile(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t n,
                                  float* y, int64_t ldy) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const void *r0 = base, *r1 = base + stride, *r2 = base + 2 * stride, *r3 = base + 3 * stride;
  __m512 s[N][4];
  for (int j = 0; j < N; ++j)
    for (int k = 0; k < 4; ++k) s[j][k] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) dot4xn_step<N>(t, r0, r1, r2, r3, x, ldx, i, kAll, s);
  if (i < n) dot4xn_step<N>(t, r0, r1, r2, r3, x, ldx, i, lanes(i, n), s);
  for (int j = 0; j < N; ++j) reduce4(s[j], y + j * ldy);
}

AVX512_FN void dot4xn_mixed_avx512(DType t, const void* w, size_t stride, const float* x, int64_t ldx, int64_t tokens,
                                   int64_t n, float* y, int64_t ldy) {
  // Tiles of four tokens (16 accumulators, the four rows and a token's x
  // in registers), then the rest as three, two or one.
  int64_t j = 0;
  for (; j + 4 <= tokens; j += 4) dot4xn_tile<4>(t, w, stride, x + j * ldx, ldx, n, y + j * ldy, ldy);
  if (tokens - j == 3) dot4xn_tile<3>(t, w, stride, x + j * ldx, ldx, n, y + j * ldy, ldy);
  else if (tokens - j == 2) dot4xn_tile<2>(t, w, stride, x + j * ldx, ldx, n, y + j * ldy, ldy);
  else if (tokens - j == 1) dot4_mixed_avx512(t, w, stride, x + j * ldx, n, y + j * ldy);  // one token: decode's own kernel
}

// One 16-column step of the panel's tile: 8 loads, 16 multiply-adds.
AVX512_INLINE_FN void panel_step(const float* a0, const float* a1, const float* a2, const float* a3, const float* x0,
                                 const float* x1, const float* x2, const float* x3, int64_t i, __mmask16 m,
                                 __m512 (&v)[16]) {
  const __m512 w0 = loadx(a0, i, m), w1 = loadx(a1, i, m), w2 = loadx(a2, i, m), w3 = loadx(a3, i, m);
  const __m512 t0 = loadx(x0, i, m);
  v[0] = _mm512_fmadd_ps(w0, t0, v[0]);
  v[4] = _mm512_fmadd_ps(w1, t0, v[4]);
  v[8] = _mm512_fmadd_ps(w2, t0, v[8]);
  v[12] = _mm512_fmadd_ps(w3, t0, v[12]);
  const __m512 t1 = loadx(x1, i, m);
  v[1] = _mm512_fmadd_ps(w0, t1, v[1]);
  v[5] = _mm512_fmadd_ps(w1, t1, v[5]);
  v[9] = _mm512_fmadd_ps(w2, t1, v[9]);
  v[13] = _mm512_fmadd_ps(w3, t1, v[13]);
  const __m512 t2 = loadx(x2, i, m);
  v[2] = _mm512_fmadd_ps(w0, t2, v[2]);
  v[6] = _mm512_fmadd_ps(w1, t2, v[6]);
  v[10] = _mm512_fmadd_ps(w2, t2, v[10]);
  v[14] = _mm512_fmadd_ps(w3, t2, v[14]);
  const __m512 t3 = loadx(x3, i, m);
  v[3] = _mm512_fmadd_ps(w0, t3, v[3]);
  v[7] = _mm512_fmadd_ps(w1, t3, v[7]);
  v[11] = _mm512_fmadd_ps(w2, t3, v[11]);
  v[15] = _mm512_fmadd_ps(w3, t3, v[15]);
}

// The 4 x 4 tile of dot_panel_f32: rows a0..a3 against tokens x0..x3 over n
// columns (n16 of them in whole 16-lane steps, then a masked step), the same
// multiply-adds per accumulator as dot_mixed_avx512. The accumulators are
// passed to the reduction in the order that leaves token j's four rows in
// quarter j, which is stored straight to y (the tree per accumulator does
// not depend on its place). Always inlined into the panel's loops, so the
// 16 accumulators live in registers (as a called function they were zeroed
// and spilled through the stack on every tile).
AVX512_INLINE_FN void panel_tile(const float* a, int64_t lda, const float* x, int64_t ldx, int64_t n, int64_t n16,
                                 float* y, int64_t ldy) {
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  // v[4k + j]: row k, token j.
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n16; i += 16) panel_step(a0, a1, a2, a3, x0, x1, x2, x3, i, kAll, v);
  if (n16 < n) panel_step(a0, a1, a2, a3, x0, x1, x2, x3, n16, lanes(n16, n), v);
  // The tree of reduce1 for 16 accumulators: element 4r + m of the result
  // is accumulator 4m + r, so with v[4k + j] = (row k, token j), element
  // 4j + k is (row k, token j).
  const __m512 u0 = level2(level1(v[0], v[1]), level1(v[2], v[3]));
  const __m512 u1 = level2(level1(v[4], v[5]), level1(v[6], v[7]));
  const __m512 u2 = level2(level1(v[8], v[9]), level1(v[10], v[11]));
  const __m512 u3 = level2(level1(v[12], v[13]), level1(v[14], v[15]));
  const __m512 s = level4(level3(u0, u1), level3(u2, u3));
  _mm_storeu_ps(y, _mm512_castps512_ps128(s));
  _mm_storeu_ps(y + ldy, _mm512_extractf32x4_ps(s, 1));
  _mm_storeu_ps(y + 2 * ldy, _mm512_extractf32x4_ps(s, 2));
  _mm_storeu_ps(y + 3 * ldy, _mm512_extractf32x4_ps(s, 3));
}

AVX512_FN void dot_panel_f32_avx512(const float* a, int64_t lda, int64_t rows, const float* x, int64_t ldx,
                                    int64_t tokens, int64_t n, float* y, int64_t ldy) {
  const int64_t rq = rows / 4 * 4, tq = tokens / 4 * 4, n16 = n / 16 * 16;
  for (int64_t t = 0; t < tq; t += 4)
    for (int64_t r = 0; r < rq; r += 4) panel_tile(a + r * lda, lda, x + t * ldx, ldx, n, n16, y + t * ldy + r, ldy);
  for (int64_t t = tq; t < tokens; ++t)
    for (int64_t r = 0; r < rq; r += 4) {
      float out[4];
      dot4_mixed_avx512(DType::F32, a + r * lda, size_t(lda) * sizeof(float), x + t * ldx, n, out);
      for (int k = 0; k < 4; ++k) y[t * ldy + r + k] = out[k];
    }
  for (int64_t r = rq; r < rows; ++r)
    for (int64_t t = 0; t < tokens; ++t) y[t * ldy + r] = dot_mixed_avx512(DType::F32, a + r * lda, x + t * ldx, n);
}

AVX512_FN void axpy_avx512(float alpha, const float* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 m = lanes(i, n);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

// exp(x) for 16 lanes: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts,
// Cody-Waite), Cephes' degree-6 polynomial for exp(r), then 2^n by vscalefps
// (which also gives 0 and inf past the range). Within 2 ulp of std::exp.
AVX512_FN inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

AVX512_FN void silu_mul_avx512(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  silu_mul_scalar(g + i, u + i, n - i);
}

AVX512_FN void silu_avx512(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_storeu_ps(x + i, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  }
  silu_scalar(x + i, n - i);
}

AVX512_FN void sigmoid_mul_avx512(float* y, const float* g, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(g + i)));
    const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(y + i), s));
  }
  sigmoid_mul_scalar(y + i, g + i, n - i);
}

// Where conv4_token_avx512's permutes read and write, for a block of 16
// channels: taps [16][4] in four registers, state [16][3] in three.
struct Conv4Lanes {
  int32_t tap[4][16];  // tap j of channel c: 4c + j of a register pair (the
                       // first pair for c < 8, the second for c >= 8)
  int32_t in_a[3][16], in_b[3][16];     // state slot j of channel c: 3c + j
  int32_t out_a[3][16], out_b[3][16];   // register k of {s1, s2, u} interleaved
};
constexpr Conv4Lanes conv4_lanes() {
  Conv4Lanes l{};
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < 16; ++c) l.tap[j][c] = 4 * (c % 8) + j;
  for (int j = 0; j < 3; ++j)
    for (int c = 0; c < 16; ++c) {
      const int e = 3 * c + j;  // in the state registers 0 | 1 | 2
      l.in_a[j][c] = e < 32 ? e : 0;               // from registers 0, 1
      l.in_b[j][c] = e < 32 ? c : 16 + (e - 32);   // kept, or from register 2
    }
  for (int k = 0; k < 3; ++k)
    for (int i = 0; i < 16; ++i) {
      const int e = 16 * k + i, c = e / 3, j = e % 3;  // j: 0 s1, 1 s2, 2 u
      l.out_a[k][i] = j == 0 ? c : 16 + c;            // from s1 | s2
      l.out_b[k][i] = j == 2 ? 16 + c : i;            // from u, or kept
    }
  return l;
}
constexpr Conv4Lanes kConv4Lanes = conv4_lanes();

AVX512_FN inline __m512i lanes_of(const int32_t (&idx)[16]) { return _mm512_loadu_si512(idx); }

// 16 channels a step: taps and state taken apart into a register per tap
// and per state slot by two-source permutes, the sums with the rounded
// product and add forms (the _round intrinsics are never fused into a
// multiply-add, so each step is rounded as conv4_token_scalar's), the
// shifted state put back together the same way. ~40 instructions for 16
// channels, against ~12 scalar ones a channel.
AVX512_FN void conv4_token_avx512(const float* taps, float* state, const float* u, int64_t n, float* y) {
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const Conv4Lanes& L = kConv4Lanes;
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const float* t = taps + c * 4;
    float* st = state + c * 3;
    const __m512 t0 = _mm512_loadu_ps(t), t1 = _mm512_loadu_ps(t + 16), t2 = _mm512_loadu_ps(t + 32),
                 t3 = _mm512_loadu_ps(t + 48);
    __m512 tap[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i idx = lanes_of(L.tap[j]);
      tap[j] = _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(t0, idx, t1), _mm512_permutex2var_ps(t2, idx, t3));
    }
    const __m512 r0 = _mm512_loadu_ps(st), r1 = _mm512_loadu_ps(st + 16), r2 = _mm512_loadu_ps(st + 32);
    __m512 s[3];
    for (int j = 0; j < 3; ++j)
      s[j] = _mm512_permutex2var_ps(_mm512_permutex2var_ps(r0, lanes_of(L.in_a[j]), r1), lanes_of(L.in_b[j]), r2);
    const __m512 uv = _mm512_loadu_ps(u + c);
    __m512 acc = _mm512_mul_round_ps(tap[3], uv, R);
    for (int j = 0; j < 3; ++j) acc = _mm512_add_round_ps(acc, _mm512_mul_round_ps(tap[j], s[j], R), R);
    _mm512_storeu_ps(y + c, acc);
    for (int k = 0; k < 3; ++k)
      _mm512_storeu_ps(st + 16 * k, _mm512_permutex2var_ps(_mm512_permutex2var_ps(s[1], lanes_of(L.out_a[k]), s[2]),
                                                           lanes_of(L.out_b[k]), uv));
  }
  conv4_token_scalar(taps + c * 4, state + c * 3, u + c, n - c, y + c);
}

}  // namespace

const Kernels kAvx512Kernels = {to_f32_avx512,     dot_mixed_avx512,     dot4_mixed_avx512,
                                dot4xn_mixed_avx512, dot_panel_f32_avx512,
                                axpy_avx512,       silu_mul_avx512,      silu_avx512,
                                sigmoid_mul_avx512, conv4_token_avx512, 16};

}  // namespace flashmoe::cpu::simd
#endif
