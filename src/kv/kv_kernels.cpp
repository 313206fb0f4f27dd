#include "kv/kv_kernels.h"

#include <cmath>

#include "core/cpu_features.h"
#include "kv/fp8_e4m3.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FLASHMOE_X86 1
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#endif

namespace flashmoe::kv_kernels {

#ifdef FLASHMOE_X86
namespace {

// E4M3 -> f16 bits: sign to bit 15, the 7 magnitude bits to bits 13..7. The
// exponent field becomes 0eeee (bias 15 instead of 7) and subnormals line up
// too, so value(f16) * 2^8 == value(e4m3) exactly; NaN codes get an all-ones
// exponent.
AVX2_FN inline __m256 fp8x8_to_f32(const uint8_t* p, __m256 mul) {
  __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i mag = _mm_and_si128(c, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
  __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), mul);
}

AVX2_FN void fp8_to_f32_avx2(const uint8_t* src, int64_t n, float scale, float* out) {
  // value * 256 is exact, so (value * 256) * (scale / 256) would round twice;
  // multiply by 256 first (exact), then by scale (one rounding).
  const __m256 k256 = _mm256_set1_ps(256.0f), s = _mm256_set1_ps(scale);
  const float* table = fp8::e4m3_table();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(fp8x8_to_f32(src + i, k256), s));
  for (; i < n; ++i) out[i] = table[src[i]] * scale;
}

AVX2_FN void fp8_to_f32_offset_avx2(const uint8_t* src, int64_t n, float scale, const float* offset, float* out) {
  const __m256 k256 = _mm256_set1_ps(256.0f), s = _mm256_set1_ps(scale);
  const float* table = fp8::e4m3_table();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(fp8x8_to_f32(src + i, k256), s), _mm256_loadu_ps(offset + i)));
  for (; i < n; ++i) out[i] = table[src[i]] * scale + offset[i];
}

// exp(x) for x <= 0 (Cephes-style range reduction + degree-6 polynomial).
AVX2_FN inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX2_FN float exp_shifted_sum_avx2(float* x, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  float sum = _mm_cvtss_f32(lo);
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - max));
  return sum;
}

AVX2_FN void weighted_rows_acc_avx2(const float* rows, int64_t ld, const float* w, int64_t nrows, float* out,
                                   int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 a0 = _mm256_loadu_ps(out + i), a1 = _mm256_loadu_ps(out + i + 8);
    __m256 a2 = _mm256_loadu_ps(out + i + 16), a3 = _mm256_loadu_ps(out + i + 24);
    for (int64_t r = 0; r < nrows; ++r) {
      const __m256 wr = _mm256_set1_ps(w[r]);
      const float* x = rows + r * ld + i;
      a0 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(x), a0);
      a1 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(x + 8), a1);
      a2 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(x + 16), a2);
      a3 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(x + 24), a3);
    }
    _mm256_storeu_ps(out + i, a0);
    _mm256_storeu_ps(out + i + 8, a1);
    _mm256_storeu_ps(out + i + 16, a2);
    _mm256_storeu_ps(out + i + 24, a3);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_loadu_ps(out + i);
    for (int64_t r = 0; r < nrows; ++r) a = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), _mm256_loadu_ps(rows + r * ld + i), a);
    _mm256_storeu_ps(out + i, a);
  }
  for (; i < n; ++i) {
    float a = out[i];
    for (int64_t r = 0; r < nrows; ++r) a += w[r] * rows[r * ld + i];
    out[i] = a;
  }
}

#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// HG heads x NB 16-lane column blocks of weighted_rows_acc_heads, all in
// registers across the rows: each row's NB blocks are loaded once for the HG
// heads. Per element: out = fma(w_r, row_r, out), r ascending, as the AVX2
// kernel does in its 8-lane halves.
template <int HG, int NB>
AVX512_FN void heads_block(const float* rows, int64_t ld, const float* w, int64_t wstride, int64_t nrows, float* out,
                           int64_t n) {
  __m512 acc[HG][NB];
  for (int h = 0; h < HG; ++h)
    for (int b = 0; b < NB; ++b) acc[h][b] = _mm512_loadu_ps(out + h * n + 16 * b);
  for (int64_t r = 0; r < nrows; ++r) {
    __m512 x[NB];
    for (int b = 0; b < NB; ++b) x[b] = _mm512_loadu_ps(rows + r * ld + 16 * b);
    for (int h = 0; h < HG; ++h) {
      const __m512 wr = _mm512_set1_ps(w[h * wstride + r]);
      for (int b = 0; b < NB; ++b) acc[h][b] = _mm512_fmadd_ps(wr, x[b], acc[h][b]);
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + h * n + 16 * b, acc[h][b]);
}

// Columns in chunks of 64 (then 16), heads in groups of 4 (then the rest).
template <int HG>
AVX512_FN void heads_group(const float* rows, int64_t ld, const float* w, int64_t wstride, int64_t nrows, float* out,
                           int64_t n) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) heads_block<HG, 4>(rows + c, ld, w, wstride, nrows, out + c, n);
  for (; c < n; c += 16) heads_block<HG, 1>(rows + c, ld, w, wstride, nrows, out + c, n);
}

void weighted_rows_acc_heads_avx512(const float* rows, int64_t ld, const float* w, int64_t wstride, int64_t heads,
                                    int64_t nrows, float* out, int64_t n) {
  int64_t h = 0;
  for (; h + 4 <= heads; h += 4) heads_group<4>(rows, ld, w + h * wstride, wstride, nrows, out + h * n, n);
  switch (heads - h) {
    case 3: heads_group<3>(rows, ld, w + h * wstride, wstride, nrows, out + h * n, n); break;
    case 2: heads_group<2>(rows, ld, w + h * wstride, wstride, nrows, out + h * n, n); break;
    case 1: heads_group<1>(rows, ld, w + h * wstride, wstride, nrows, out + h * n, n); break;
    default: break;
  }
}

}  // namespace
#endif

void weighted_rows_acc_heads(const float* rows, int64_t ld, const float* w, int64_t wstride, int64_t heads,
                             int64_t nrows, float* out, int64_t n) {
#ifdef FLASHMOE_X86
  if (n % 16 == 0 && cpu_level() >= CpuLevel::Avx512)
    return weighted_rows_acc_heads_avx512(rows, ld, w, wstride, heads, nrows, out, n);
#endif
  for (int64_t h = 0; h < heads; ++h) weighted_rows_acc(rows, ld, w + h * wstride, nrows, out + h * n, n);
}

void weighted_rows_acc(const float* rows, int64_t ld, const float* w, int64_t nrows, float* out, int64_t n) {
#ifdef FLASHMOE_X86
  if (avx2_available()) return weighted_rows_acc_avx2(rows, ld, w, nrows, out, n);
#endif
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t i = 0; i < n; ++i) out[i] += w[r] * rows[r * ld + i];
}

void hadamard_ortho(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float s = 1.0f / std::sqrt(float(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void fp8_e4m3_to_f32(const uint8_t* src, int64_t n, float scale, float* out) {
#ifdef FLASHMOE_X86
  if (avx2_available()) return fp8_to_f32_avx2(src, n, scale, out);
#endif
  const float* table = fp8::e4m3_table();
  for (int64_t i = 0; i < n; ++i) out[i] = table[src[i]] * scale;
}

void fp8_e4m3_to_f32_offset(const uint8_t* src, int64_t n, float scale, const float* offset, float* out) {
#ifdef FLASHMOE_X86
  if (avx2_available()) return fp8_to_f32_offset_avx2(src, n, scale, offset, out);
#endif
  const float* table = fp8::e4m3_table();
  for (int64_t i = 0; i < n; ++i) out[i] = table[src[i]] * scale + offset[i];
}

float exp_shifted_sum(float* x, int64_t n, float max) {
#ifdef FLASHMOE_X86
  if (avx2_available()) return exp_shifted_sum_avx2(x, n, max);
#endif
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - max));
  return sum;
}

}  // namespace flashmoe::kv_kernels
