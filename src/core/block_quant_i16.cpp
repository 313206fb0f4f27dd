#include "core/block_quant_i16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FLASHMOE_X86 1
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#endif

namespace flashmoe::cpu {

namespace {

constexpr float kCodeMax = 32767.0f;
constexpr float kLoSteps = 65536.0f;  // low codes per high code step

void quantize_scalar(const float* x, int64_t cols, Int16Activations& out) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0, sum = 0;
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, std::fabs(xb[i]));
      sum += xb[i];
    }
    const float inv = amax > 0 ? kCodeMax / amax : 0.0f;
    int16_t* c = out.code.data() + 64 * b;
    for (int i = 0; i < 32; ++i) {
      const float hi = float(std::lrint(xb[i] * inv));
      c[(i % 2) * 16 + i / 2] = int16_t(hi);
      const long lo = std::lrint(std::fma(xb[i], inv, -hi) * kLoSteps);
      c[32 + (i % 2) * 16 + i / 2] = int16_t(std::clamp(lo, -32767L, 32767L));
    }
    out.scale[size_t(b)] = amax / kCodeMax;
    out.sum[size_t(b)] = sum;
  }
}

#ifdef FLASHMOE_X86
AVX2_FN inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

AVX2_FN inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// Lanes `Sel` of a and c (per 128-bit half: two of a, then two of c).
template <int Sel>
AVX2_FN inline __m256i pick(__m256i a, __m256i c) {
  return _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(c), Sel));
}

// 32 int32 codes (4 vectors of 8 columns) as int16, even columns then odd
// (packs saturates a low code of exactly +-32768 to +-32767).
AVX2_FN inline void store_deinterleaved(const __m256i i[4], int16_t* c, __m256i order) {
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m256i ev = _mm256_packs_epi32(pick<even>(i[0], i[1]), pick<even>(i[2], i[3]));
  const __m256i od = _mm256_packs_epi32(pick<odd>(i[0], i[1]), pick<odd>(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), _mm256_permutevar8x32_epi32(ev, order));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 16), _mm256_permutevar8x32_epi32(od, order));
}

// As quantize_scalar, 8 columns per instruction: cvtps rounds to nearest
// even like lrint. The even (odd) columns of a block's 4 int32 vectors are
// gathered by shuffle_ps and packs into 64-bit chunks out of order, put back
// in order by one lane permutation.
AVX2_FN void quantize_avx2(const float* x, int64_t cols, Int16Activations& out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + 32 * b;
    const __m256 f0 = _mm256_loadu_ps(xb), f1 = _mm256_loadu_ps(xb + 8), f2 = _mm256_loadu_ps(xb + 16),
                 f3 = _mm256_loadu_ps(xb + 24);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f0), _mm256_andnot_ps(sign, f1)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, f2), _mm256_andnot_ps(sign, f3)));
    const float amax = hmax(m);
    const __m256 inv = _mm256_set1_ps(amax > 0 ? kCodeMax / amax : 0.0f);
    int16_t* c = out.code.data() + 64 * b;
    const __m256 f[4] = {f0, f1, f2, f3};
    __m256i hi[4], lo[4];
    for (int k = 0; k < 4; ++k) {
      hi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(f[k], inv));
      const __m256 rest = _mm256_fmsub_ps(f[k], inv, _mm256_cvtepi32_ps(hi[k]));
      lo[k] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(kLoSteps)));
    }
    store_deinterleaved(hi, c, order);
    store_deinterleaved(lo, c + 32, order);
    out.scale[size_t(b)] = amax / kCodeMax;
    out.sum[size_t(b)] = hsum(_mm256_add_ps(_mm256_add_ps(f0, f1), _mm256_add_ps(f2, f3)));
  }
}

AVX2_FN inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Sum of w * (high code + low code / 65536) over one block of 32 (8 lanes
// of partial sums, each sum of integers exact): w's 32 values given as the
// 16-bit lanes `even` (columns 0, 2, ..., 30) and `odd`.
AVX2_FN inline __m256i idot32(__m256i even, __m256i odd, const int16_t* code) {
  return _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(code))),
                          _mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(code + 16))));
}
AVX2_FN inline __m256 dot32(__m256i even, __m256i odd, const int16_t* code) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32(even, odd, code + 32)), _mm256_set1_ps(1.0f / kLoSteps),
                         _mm256_cvtepi32_ps(idot32(even, odd, code)));
}

// Q8_0: a block's 32 int8 as 16-bit lanes, sign-extended by shifts.
AVX2_FN inline __m256 dot_q8_0(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 34 * b;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m256 p = dot32(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), _mm256_srai_epi16(v, 8),
                           x.code.data() + 64 * b);
    const __m256 f = _mm256_set1_ps(half(blk) * x.scale[size_t(b)]);
    if (b % 2) a1 = _mm256_fmadd_ps(p, f, a1);
    else a0 = _mm256_fmadd_ps(p, f, a0);
  }
  return _mm256_add_ps(a0, a1);
}

// Q5_0: 16 bytes of nibbles (byte j: weight j low, j + 16 high) as 16-bit
// lanes with the high nibbles' copy in the upper half: lane i of the
// masked low byte is weight 2i of the block's even columns in order, the
// high byte weight 2i + 1. The fifth bit of weight k is bit k of qh: lane i
// tests bit 2(i % 8) (+1 for odd columns) of qh's low 16 bits (lanes 0-7)
// or high 16 bits (lanes 8-15).
AVX2_FN inline __m256 dot_q5_0(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  const __m256i m4 = _mm256_set1_epi16(0x000F), sixteen = _mm256_set1_epi16(16);
  const __m256i bit_even = _mm256_setr_epi16(1, 4, 16, 64, 256, 1024, 4096, 16384, 1, 4, 16, 64, 256, 1024, 4096, 16384);
  const __m256i bit_odd = _mm256_slli_epi16(bit_even, 1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 22 * b;
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
    const __m256i q = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    const __m256i h = _mm256_set_m128i(_mm_set1_epi16(short(qh >> 16)), _mm_set1_epi16(short(qh & 0xFFFF)));
    // (q | bit << 4) - 16 = q - 16 + 16 * bit, bit from the compare's 0 / -1.
    const __m256i ev = _mm256_sub_epi16(_mm256_sub_epi16(_mm256_and_si256(q, m4), sixteen),
                                        _mm256_slli_epi16(_mm256_cmpeq_epi16(_mm256_and_si256(h, bit_even), bit_even), 4));
    const __m256i od =
        _mm256_sub_epi16(_mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 8), m4), sixteen),
                         _mm256_slli_epi16(_mm256_cmpeq_epi16(_mm256_and_si256(h, bit_odd), bit_odd), 4));
    const __m256 p = dot32(ev, od, x.code.data() + 64 * b);
    const __m256 f = _mm256_set1_ps(half(blk) * x.scale[size_t(b)]);
    if (b % 2) a1 = _mm256_fmadd_ps(p, f, a1);
    else a0 = _mm256_fmadd_ps(p, f, a0);
  }
  return _mm256_add_ps(a0, a1);
}

// Q4_K: the 12 bytes of 6-bit (scale, min) pairs unpacked to 8 scales
// (bytes 0-7) and 8 mins (bytes 8-15), ggml's bit layout.
inline void k_scales_mins(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
  u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  u[2] = mins_lo;
  u[0] &= 0x3f3f3f3fu;
  std::memcpy(out, u, 16);
}

// Q4_K: d * sum_j s_j * (q . x)_j - dmin * sum_j m_j * sum(x)_j over the 8
// sub-blocks j; a 16-bit lane of nibble bytes holds 4 weights, split by
// masks and shifts (low nibbles: sub-block j, high: j + 1).
AVX2_FN inline __m256 dot_q4_k(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  const __m256i m4 = _mm256_set1_epi16(0x000F);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, amin = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 144 * b;
    alignas(16) uint8_t sm[16];
    k_scales_mins(blk + 4, sm);
    const __m128i smv = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
    const float* xs = x.scale.data() + 8 * b;
    const __m256 sf = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smv)), _mm256_set1_ps(half(blk))),
                                    _mm256_loadu_ps(xs));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8)));
    amin = _mm256_fmadd_ps(_mm256_set1_ps(half(blk + 2)), _mm256_mul_ps(mins, _mm256_loadu_ps(x.sum.data() + 8 * b)),
                           amin);
    const int16_t* code = x.code.data() + 512 * b;
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p));
      const __m256 lo = dot32(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 8), m4), code + 128 * p);
      const __m256 hi =
          dot32(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_srli_epi16(v, 12), code + 128 * p + 64);
      a0 = _mm256_fmadd_ps(lo, _mm256_permutevar8x32_ps(sf, _mm256_set1_epi32(2 * p)), a0);
      a1 = _mm256_fmadd_ps(hi, _mm256_permutevar8x32_ps(sf, _mm256_set1_epi32(2 * p + 1)), a1);
    }
  }
  return _mm256_sub_ps(_mm256_add_ps(a0, a1), amin);
}

// Bits S..S+1 of each byte of qh, moved to bits 4..5.
template <int S>
AVX2_FN inline __m256i q6_high(__m256i h, __m256i m2) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, S), m2), 4);
}

// Q6_K: per half block of 128, four runs of 32 6-bit values (as in
// block_quant.cpp's dot_q6_k_avx2), each one activation block; int32 lanes
// 0-3 of a run's sum hold its first 16 columns (scale 2k), lanes 4-7 the
// next 16 (scale 2k + 1).
AVX2_FN inline __m256 dot_q6_k(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  const __m256i lo8 = _mm256_set1_epi16(0x00FF), off = _mm256_set1_epi16(32);
  const __m256i spread[2] = {_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)};
  const __m256i pair[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                           _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 210 * b;
    // Per run (activation block) of this block: d * that block's scale.
    const __m256 da = _mm256_mul_ps(_mm256_set1_ps(half(blk + 208)), _mm256_loadu_ps(x.scale.data() + 8 * b));
    const int16_t* code = x.code.data() + 512 * b;
    for (int n = 0; n < 2; ++n) {
      const __m256 sc = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * n))));
      const __m256 g = _mm256_mul_ps(sc, _mm256_permutevar8x32_ps(da, spread[n]));
      const uint8_t* ql = blk + 64 * n;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * n));
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), q6_high<0>(h, m2)),
          _mm256_or_si256(_mm256_and_si256(l1, m4), q6_high<2>(h, m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), q6_high<4>(h, m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), q6_high<6>(h, m2)),
      };
      for (int k = 0; k < 4; ++k) {
        const __m256 p = dot32(_mm256_sub_epi16(_mm256_and_si256(q[k], lo8), off),
                               _mm256_sub_epi16(_mm256_srli_epi16(q[k], 8), off), code + 256 * n + 64 * k);
        const __m256 f = _mm256_permutevar8x32_ps(g, pair[k]);
        if (k % 2) a1 = _mm256_fmadd_ps(p, f, a1);
        else a0 = _mm256_fmadd_ps(p, f, a0);
      }
    }
  }
  return _mm256_add_ps(a0, a1);
}
#endif

}  // namespace

void quantize_activations_i16(const float* x, int64_t cols, Int16Activations& out) {
  if (cols <= 0 || cols % 32 != 0)
    fail("quantize_activations_i16: " + std::to_string(cols) + " columns is not a whole number of blocks of 32");
  out.cols = cols;
  out.code.resize(size_t(2 * cols));
  out.scale.resize(size_t(cols / 32));
  out.sum.resize(size_t(cols / 32));
#ifdef FLASHMOE_X86
  if (cpu_level() >= CpuLevel::Avx2) return quantize_avx2(x, cols, out);
#endif
  quantize_scalar(x, cols, out);
}

bool block_dot_i16_supported(CpuLevel level, QuantKind q) {
#ifdef FLASHMOE_X86
  return level >= CpuLevel::Avx2 && (q == QuantKind::Q4_K || q == QuantKind::Q6_K || q == QuantKind::Q8_0 ||
                                   q == QuantKind::Q5_0);
#else
  (void)level;
  (void)q;
  return false;
#endif
}

namespace {

void check_i16(CpuLevel level, const Matrix& W, const Int16Activations& x) {
  if (!block_dot_i16_supported(level, W.quant) || x.cols != W.cols || W.cols % block_elems(W.quant) != 0)
    fail(std::string("block_dot_row_i16: not available at level ") + cpu_level_name(level) + " for a " +
         quant_name(W.quant) + " matrix of " + std::to_string(W.cols) + " columns against " + std::to_string(x.cols) +
         " activations");
}

#ifdef FLASHMOE_X86
// The row loop inlined around one kind's kernel (rows of coder-mini's
// experts are a single block: per-row calls cost as much as the block).
// The sums of four rows' 8 partial sums, ((0+1)+(2+3))+((4+5)+(6+7)) each:
// 3 hadds instead of 4 horizontal sums.
AVX2_FN inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// The row loop inlined around one kind's kernel (rows of coder-mini's
// experts are a single block: per-row calls cost as much as the block). A
// leftover row is summed in the same order, so a row's value does not
// depend on which rows share the call (threads split rows anywhere).
template <__m256 (*Dot)(const uint8_t*, int64_t, const Int16Activations&)>
AVX2_FN void rows(const Matrix& W, int64_t r0, int64_t r1, const Int16Activations& x, float* y) {
  const size_t rb = W.row_bytes();
  const int64_t nb = W.cols / block_elems(W.quant);
  const uint8_t* base = static_cast<const uint8_t*>(W.data);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint8_t* p = base + size_t(r) * rb;
    _mm_storeu_ps(y + r, sum4(Dot(p, nb, x), Dot(p + rb, nb, x), Dot(p + 2 * rb, nb, x), Dot(p + 3 * rb, nb, x)));
  }
  for (; r < r1; ++r) {
    const __m256 a = Dot(base + size_t(r) * rb, nb, x);
    y[r] = _mm_cvtss_f32(sum4(a, a, a, a));
  }
}
#endif

}  // namespace

void block_dot_rows_i16_at(CpuLevel level, const Matrix& W, int64_t r0, int64_t r1, const Int16Activations& x,
                           float* y) {
  check_i16(level, W, x);
#ifdef FLASHMOE_X86
  switch (W.quant) {
    case QuantKind::Q8_0: return rows<dot_q8_0>(W, r0, r1, x, y);
    case QuantKind::Q4_K: return rows<dot_q4_k>(W, r0, r1, x, y);
    case QuantKind::Q5_0: return rows<dot_q5_0>(W, r0, r1, x, y);
    default: return rows<dot_q6_k>(W, r0, r1, x, y);
  }
#else
  (void)r0, (void)r1, (void)y;
#endif
}

float block_dot_row_i16_at(CpuLevel level, const Matrix& W, int64_t r, const Int16Activations& x) {
  float y[1];
  block_dot_rows_i16_at(level, W.slice_rows(r, 1), 0, 1, x, y);
  return y[0];
}

}  // namespace flashmoe::cpu
