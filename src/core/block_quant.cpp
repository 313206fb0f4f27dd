#include "core/block_quant.h"

#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 intrinsics trip -Wuninitialized (see simd_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "core/x86_hsum.h"
#define FLASHMOE_X86 1
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif

namespace flashmoe {

int64_t block_elems(QuantKind q) {
  switch (q) {
    case QuantKind::Q4_K: case QuantKind::Q5_K: case QuantKind::Q6_K: case QuantKind::IQ4_XS: return 256;
    case QuantKind::None: case QuantKind::Q8: case QuantKind::Q4: case QuantKind::Fp8Block: return 1;
    default: return 32;
  }
}

int64_t block_bytes(QuantKind q) {
  switch (q) {
    case QuantKind::Q8_0: return 34;
    case QuantKind::Q4_0: return 18;
    case QuantKind::Q4_1: return 20;
    case QuantKind::Q5_0: return 22;
    case QuantKind::Q5_1: return 24;
    case QuantKind::IQ4_NL: return 18;
    case QuantKind::Q4_K: return 144;
    case QuantKind::Q5_K: return 176;
    case QuantKind::Q6_K: return 210;
    case QuantKind::IQ4_XS: return 136;
    default: return 0;
  }
}

}  // namespace flashmoe

namespace flashmoe::cpu {

namespace {

// The 16 non-uniform levels of IQ4_NL / IQ4_XS.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// f16 -> f32, exact, inline (a block's scales are read once per 32 weights):
// the exponent-and-mantissa bits shifted into an f32 are the value times
// 2^-112, subnormals included; Inf / NaN keep an all-ones exponent.
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t em = h & 0x7fffu;
  uint32_t bits = em << 13;
  float f;
  if (em >= 0x7c00u) {
    bits |= 0x7f800000u;
    std::memcpy(&f, &bits, 4);
  } else {
    std::memcpy(&f, &bits, 4);
    f *= 0x1p112f;
  }
  return (h & 0x8000u) ? -f : f;
}

inline void deq_q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = float(q[j]) * d;
}

inline void deq_q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(int(q[j] & 0xF) - 8) * d;
    y[j + 16] = float(int(q[j] >> 4) - 8) * d;
  }
}

inline void deq_q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(q[j] & 0xF) * d + m;
    y[j + 16] = float(q[j] >> 4) * d + m;
  }
}

// Q5_0 / Q5_1: bit j of qh is the fifth bit of weight j.
inline void deq_q5(const uint8_t* b, float* y, bool with_min) {
  const float d = half(b), m = with_min ? half(b + 2) : 0.0f;
  const uint8_t* p = b + (with_min ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const uint8_t* q = p + 4;
  const int off = with_min ? 0 : 16;
  for (int j = 0; j < 16; ++j) {
    const int h0 = int((qh >> j) & 1) << 4, h1 = int((qh >> (j + 16)) & 1) << 4;
    const int x0 = int(q[j] & 0xF) | h0, x1 = int(q[j] >> 4) | h1;
    if (with_min) {
      y[j] = float(x0) * d + m;
      y[j + 16] = float(x1) * d + m;
    } else {
      y[j] = float(x0 - off) * d;
      y[j + 16] = float(x1 - off) * d;
    }
  }
}

inline void deq_iq4_nl(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(kIq4Values[q[j] & 0xF]);
    y[j + 16] = d * float(kIq4Values[q[j] >> 4]);
  }
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block.
inline void k_scale_min(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (qh == nullptr) and Q5_K: 8 sub-blocks of 32; pairs of sub-blocks
// share 32 bytes of nibbles (low nibble: the first, high: the second).
inline void deq_qk(const uint8_t* b, float* y, bool five) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = five ? b + 16 : nullptr;
  const uint8_t* q = five ? b + 48 : b + 16;
  for (int j = 0; j < 8; j += 2) {
    int s0, m0, s1, m1;
    k_scale_min(j, sc, &s0, &m0);
    k_scale_min(j + 1, sc, &s1, &m1);
    const float d1 = d * float(s0), mm1 = dmin * float(m0), d2 = d * float(s1), mm2 = dmin * float(m1);
    for (int l = 0; l < 32; ++l) {
      const int h = five ? ((qh[l] >> j) & 1) << 4 : 0;
      y[l] = d1 * float((q[l] & 0xF) + h) - mm1;
    }
    for (int l = 0; l < 32; ++l) {
      const int h = five ? ((qh[l] >> (j + 1)) & 1) << 4 : 0;
      y[l + 32] = d2 * float((q[l] >> 4) + h) - mm2;
    }
    q += 32;
    y += 64;
  }
}

inline void deq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < 2; ++n) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = int((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * float(sc[is]) * float(q1);
      y[l + 32] = d * float(sc[is + 2]) * float(q2);
      y[l + 64] = d * float(sc[is + 4]) * float(q3);
      y[l + 96] = d * float(sc[is + 6]) * float(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

inline void deq_iq4_xs(const uint8_t* b, float* y) {
  const float d = half(b);
  uint16_t sh;
  std::memcpy(&sh, b + 2, 2);
  const uint8_t* sl = b + 4;
  const uint8_t* q = b + 8;
  for (int ib = 0; ib < 8; ++ib) {
    const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
    const float dl = d * float(ls - 32);
    for (int j = 0; j < 16; ++j) {
      y[j] = dl * float(kIq4Values[q[j] & 0xF]);
      y[j + 16] = dl * float(kIq4Values[q[j] >> 4]);
    }
    y += 32;
    q += 16;
  }
}

__attribute__((always_inline)) inline void deq(QuantKind k, const uint8_t* b, float* y) {
  switch (k) {
    case QuantKind::Q8_0: return deq_q8_0(b, y);
    case QuantKind::Q4_0: return deq_q4_0(b, y);
    case QuantKind::Q4_1: return deq_q4_1(b, y);
    case QuantKind::Q5_0: return deq_q5(b, y, false);
    case QuantKind::Q5_1: return deq_q5(b, y, true);
    case QuantKind::IQ4_NL: return deq_iq4_nl(b, y);
    case QuantKind::Q4_K: return deq_qk(b, y, false);
    case QuantKind::Q5_K: return deq_qk(b, y, true);
    case QuantKind::Q6_K: return deq_q6_k(b, y);
    case QuantKind::IQ4_XS: return deq_iq4_xs(b, y);
    default: fail(std::string("not a block-quantised kind: ") + quant_name(k));
  }
}

const uint8_t* row_ptr(const Matrix& W, int64_t r) {
  return static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_bytes();
}

float dot_generic(const Matrix& W, int64_t r, const float* x) {
  const int64_t be = block_elems(W.quant), bb = block_bytes(W.quant), nb = W.cols / be;
  const uint8_t* row = row_ptr(W, r);
  float tmp[256];
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b) {
    deq(W.quant, row + b * bb, tmp);
    const float* xb = x + b * be;
    float part = 0;
    for (int64_t j = 0; j < be; ++j) part += tmp[j] * xb[j];
    acc += part;
  }
  return acc;
}

#ifdef FLASHMOE_X86
// Q8_0: the 32 int8 of a block widened 8 at a time, times d, against x.
AVX2_FN float dot_q8_0_avx2(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 32;
  const uint8_t* row = row_ptr(W, r);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(short(h)));
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    const float* xb = x + b * 32;
    for (int k = 0; k < 32; k += 16) {
      const __m256 w0 = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)))), d);
      const __m256 w1 = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k + 8)))), d);
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + k), a0);
      a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + k + 8), a1);
    }
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

AVX2_FN inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// acc += (q * scale + bias) . x over 32 unsigned bytes q.
AVX2_FN inline void fma_u8x32(__m256i q, __m256 scale, __m256 bias, const float* x, __m256& a0, __m256& a1) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int k = 0; k < 4; ++k) {
    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k])), scale, bias);
    if (k % 2) a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * k), a1);
    else a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * k), a0);
  }
}

// As fma_u8x32 with one (scale, bias) for bytes 0-15 and another for 16-31.
AVX2_FN inline void fma_u8x32_halves(__m256i q, __m256 s0, __m256 b0, __m256 s1, __m256 b1, const float* x,
                                     __m256& a0, __m256& a1) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int k = 0; k < 4; ++k) {
    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k])), k < 2 ? s0 : s1, k < 2 ? b0 : b1);
    if (k % 2) a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * k), a1);
    else a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * k), a0);
  }
}

// Bits S..S+1 of each byte of qh, moved to bits 4..5.
template <int S>
AVX2_FN inline __m256i q6_high(__m256i h, __m256i m2) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, S), m2), 4);
}

// Q6_K: half block n (of 2) of a 210-byte block as four 32-lane runs of
// unsigned 6-bit values, each 4 low bits from ql and 2 high bits from qh.
AVX2_FN inline void q6_k_runs(const uint8_t* blk, int n, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  const uint8_t* ql = blk + 64 * n;
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * n));
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), q6_high<0>(h, m2));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), q6_high<2>(h, m2));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), q6_high<4>(h, m2));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), q6_high<6>(h, m2));
}

// Q6_K: per half block of 128, four 32-lane runs of 6-bit values, each
// 4 low bits from ql and 2 high bits from qh; (q - 32) * d * sc as one fma
// of q * ds + (-32 ds), which rounds the same.
AVX2_FN float dot_q6_k_avx2(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 256;
  const uint8_t* row = row_ptr(W, r);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 210;
    const float d = half_f16c(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int n = 0; n < 2; ++n) {
      __m256i q[4];
      q6_k_runs(blk, n, q);
      const float* xb = x + b * 256 + 128 * n;
      const int8_t* s = sc + 8 * n;
      for (int k = 0; k < 4; ++k) {
        const float d0 = d * float(s[2 * k]), d1 = d * float(s[2 * k + 1]);
        fma_u8x32_halves(q[k], _mm256_set1_ps(d0), _mm256_set1_ps(-32.0f * d0), _mm256_set1_ps(d1),
                         _mm256_set1_ps(-32.0f * d1), xb + 32 * k, a0, a1);
      }
    }
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// acc += (t * scale) . x over 32 signed bytes t.
AVX2_FN inline void mul_i8x32(__m256i t, __m256 scale, const float* x, __m256& a0, __m256& a1) {
  const __m128i lo = _mm256_castsi256_si128(t), hi = _mm256_extracti128_si256(t, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int k = 0; k < 4; ++k) {
    const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[k])), scale);
    if (k % 2) a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * k), a1);
    else a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * k), a0);
  }
}

// IQ4_NL / IQ4_XS: 16 bytes of nibbles -> 32 table values by a byte shuffle.
AVX2_FN inline __m256i iq4_values(const uint8_t* qs) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), mask)),
                          _mm_shuffle_epi8(table, _mm_and_si128(v, mask)));
}

AVX2_FN float dot_iq4_nl_avx2(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 32;
  const uint8_t* row = row_ptr(W, r);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 18;
    mul_i8x32(iq4_values(blk + 2), _mm256_set1_ps(half_f16c(blk)), x + b * 32, a0, a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

AVX2_FN float dot_iq4_xs_avx2(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 256;
  const uint8_t* row = row_ptr(W, r);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 136;
    const float d = half_f16c(blk);
    uint16_t sh;
    std::memcpy(&sh, blk + 2, 2);
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
      mul_i8x32(iq4_values(blk + 8 + 16 * ib), _mm256_set1_ps(d * float(ls - 32)), x + b * 256 + 32 * ib, a0, a1);
    }
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// Q4_0: 16 bytes -> 32 nibbles (low halves are weights 0-15, high 16-31);
// (q - 8) * d computed as one fma of q * d + (-8d), which rounds the same.
AVX2_FN float dot_q4_0_avx2(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 32;
  const uint8_t* row = row_ptr(W, r);
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 18;
    const float d = half_f16c(blk);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
    fma_u8x32(q, _mm256_set1_ps(d), _mm256_set1_ps(-8.0f * d), x + b * 32, a0, a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// The 32 bits of qh as 32 bytes, byte j = 0x10 when bit j is set, else 0.
AVX2_FN inline __m256i bits_to_0x10(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Q5_0: a 22-byte block's 32 unsigned 5-bit values, nibbles as Q4_0 plus
// a fifth bit per weight from qh.
AVX2_FN inline __m256i q5_0_values(const uint8_t* blk) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
  const __m256i lo4 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
  return _mm256_or_si256(lo4, bits_to_0x10(qh));
}

// Q5_0: (q - 16) * d as one fma of q * d + (-16d).
AVX2_FN float dot_q5_0_avx2(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 32;
  const uint8_t* row = row_ptr(W, r);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 22;
    const float d = half_f16c(blk);
    fma_u8x32(q5_0_values(blk), _mm256_set1_ps(d), _mm256_set1_ps(-16.0f * d), x + b * 32, a0, a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// Q4_K: sub-blocks j and j + 1 (j even) of a 144-byte block: the 32 bytes
// whose low nibbles are sub-block j and high nibbles j + 1, as two runs of
// 32 unsigned values, and each sub-block's scale d * sc and bias -dmin * m.
struct Q4KPair {
  __m256i lo, hi;
  float s0, b0, s1, b1;
};
AVX2_FN inline Q4KPair q4_k_pair(const uint8_t* blk, int j) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const float d = half_f16c(blk), dmin = half_f16c(blk + 2);
  int s0, m0, s1, m1;
  k_scale_min(j, blk + 4, &s0, &m0);
  k_scale_min(j + 1, blk + 4, &s1, &m1);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 16 * j));
  return {_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), d * float(s0),
          -(dmin * float(m0)), d * float(s1), -(dmin * float(m1))};
}

AVX2_FN float dot_q4_k_avx2(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 256;
  const uint8_t* row = row_ptr(W, r);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 144;
    const float* xb = x + b * 256;
    for (int j = 0; j < 8; j += 2) {
      const Q4KPair p = q4_k_pair(blk, j);
      fma_u8x32(p.lo, _mm256_set1_ps(p.s0), _mm256_set1_ps(p.b0), xb + 32 * j, a0, a1);
      fma_u8x32(p.hi, _mm256_set1_ps(p.s1), _mm256_set1_ps(p.b1), xb + 32 * j + 32, a0, a1);
    }
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// Other kinds: a block is expanded into registers-sized chunks of a stack
// buffer (the expansion code is compiled for AVX2 here, so the compiler
// vectorises it), then multiplied 16 lanes at a time.
template <QuantKind K>
AVX2_FN float dot_block_avx2(const Matrix& W, int64_t r, const float* x) {
  constexpr int64_t be = K == QuantKind::Q4_K || K == QuantKind::Q5_K || K == QuantKind::Q6_K || K == QuantKind::IQ4_XS ? 256 : 32;
  const int64_t bb = block_bytes(K), nb = W.cols / be;
  const uint8_t* row = row_ptr(W, r);
  alignas(32) float tmp[be];
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    deq(K, row + b * bb, tmp);
    const float* xb = x + b * be;
    for (int64_t j = 0; j < be; j += 16) {
      a0 = _mm256_fmadd_ps(_mm256_load_ps(tmp + j), _mm256_loadu_ps(xb + j), a0);
      a1 = _mm256_fmadd_ps(_mm256_load_ps(tmp + j + 8), _mm256_loadu_ps(xb + j + 8), a1);
    }
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// AVX-512: the kinds of a Q4_K_M file's largest tensors (Q4_K, Q6_K, and
// the Q5_0 / Q8_0 down experts) 16 weights per instruction: on this
// machine's cores the 256-bit kernels above spend 3 FMA-port uops per 8
// weights (widen, scale, multiply-add), these the same 3 per 16.

// acc += (q * scale + bias) . x over 16 unsigned bytes q.
AVX512_FN inline __m512 fma_u8x16(__m128i q, __m512 scale, __m512 bias, const float* x, __m512 acc) {
  const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), scale, bias);
  return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc);
}

AVX512_FN float dot_q4_k_avx512(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 256;
  const uint8_t* row = row_ptr(W, r);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 144;
    const float* xb = x + b * 256;
    for (int j = 0; j < 8; j += 2) {
      const Q4KPair p = q4_k_pair(blk, j);
      const __m512 sc0 = _mm512_set1_ps(p.s0), bi0 = _mm512_set1_ps(p.b0);
      const __m512 sc1 = _mm512_set1_ps(p.s1), bi1 = _mm512_set1_ps(p.b1);
      const float* xj = xb + 32 * j;
      a0 = fma_u8x16(_mm256_castsi256_si128(p.lo), sc0, bi0, xj, a0);
      a1 = fma_u8x16(_mm256_extracti128_si256(p.lo, 1), sc0, bi0, xj + 16, a1);
      a0 = fma_u8x16(_mm256_castsi256_si128(p.hi), sc1, bi1, xj + 32, a0);
      a1 = fma_u8x16(_mm256_extracti128_si256(p.hi, 1), sc1, bi1, xj + 48, a1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// Q6_K as dot_q6_k_avx2: bytes 0-15 of each 32-lane run take one scale,
// bytes 16-31 the next.
AVX512_FN float dot_q6_k_avx512(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 256;
  const uint8_t* row = row_ptr(W, r);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 210;
    const float d = half_f16c(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int n = 0; n < 2; ++n) {
      __m256i q[4];
      q6_k_runs(blk, n, q);
      const float* xb = x + b * 256 + 128 * n;
      const int8_t* s = sc + 8 * n;
      for (int k = 0; k < 4; ++k) {
        const float d0 = d * float(s[2 * k]), d1 = d * float(s[2 * k + 1]);
        a0 = fma_u8x16(_mm256_castsi256_si128(q[k]), _mm512_set1_ps(d0), _mm512_set1_ps(-32.0f * d0), xb + 32 * k, a0);
        a1 = fma_u8x16(_mm256_extracti128_si256(q[k], 1), _mm512_set1_ps(d1), _mm512_set1_ps(-32.0f * d1),
                       xb + 32 * k + 16, a1);
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// Q5_0 as dot_q5_0_avx2, 16 weights per step.
AVX512_FN float dot_q5_0_avx512(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 32;
  const uint8_t* row = row_ptr(W, r);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 22;
    const float d = half_f16c(blk);
    const __m256i q = q5_0_values(blk);
    const __m512 sc = _mm512_set1_ps(d), bi = _mm512_set1_ps(-16.0f * d);
    a0 = fma_u8x16(_mm256_castsi256_si128(q), sc, bi, x + b * 32, a0);
    a1 = fma_u8x16(_mm256_extracti128_si256(q, 1), sc, bi, x + b * 32 + 16, a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// Q8_0 as dot_q8_0_avx2, 16 weights per step.
AVX512_FN float dot_q8_0_avx512(const Matrix& W, int64_t r, const float* x) {
  const int64_t nb = W.cols / 32;
  const uint8_t* row = row_ptr(W, r);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const __m512 d = _mm512_set1_ps(half_f16c(blk));
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
    a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * 32), a0);
    a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * 32 + 16), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

float dot_avx2(const Matrix& W, int64_t r, const float* x) {
  switch (W.quant) {
    case QuantKind::Q8_0: return dot_q8_0_avx2(W, r, x);
    case QuantKind::Q4_0: return dot_q4_0_avx2(W, r, x);
    case QuantKind::Q4_1: return dot_block_avx2<QuantKind::Q4_1>(W, r, x);
    case QuantKind::Q5_0: return dot_q5_0_avx2(W, r, x);
    case QuantKind::Q5_1: return dot_block_avx2<QuantKind::Q5_1>(W, r, x);
    case QuantKind::IQ4_NL: return dot_iq4_nl_avx2(W, r, x);
    case QuantKind::Q4_K: return dot_q4_k_avx2(W, r, x);
    case QuantKind::Q5_K: return dot_block_avx2<QuantKind::Q5_K>(W, r, x);
    case QuantKind::Q6_K: return dot_q6_k_avx2(W, r, x);
    case QuantKind::IQ4_XS: return dot_iq4_xs_avx2(W, r, x);
    default: return dot_generic(W, r, x);
  }
}
#endif

void check(const Matrix& W) {
  if (!W.block_quantized() || W.cols % block_elems(W.quant) != 0)
    fail(std::string("block-quantised matrix [") + std::to_string(W.rows) + ", " + std::to_string(W.cols) +
         "] of kind " + quant_name(W.quant) + ": columns are not a whole number of blocks");
}

}  // namespace

void block_dequant(QuantKind q, const uint8_t* block, float* out) { deq(q, block, out); }

void block_dequant_row(const Matrix& W, int64_t r, float* out) {
  check(W);
  const int64_t be = block_elems(W.quant), bb = block_bytes(W.quant), nb = W.cols / be;
  const uint8_t* row = row_ptr(W, r);
  for (int64_t b = 0; b < nb; ++b) deq(W.quant, row + b * bb, out + b * be);
}

float block_dot_row_at(CpuLevel level, const Matrix& W, int64_t r, const float* x) {
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx512) switch (W.quant) {
      case QuantKind::Q4_K: return dot_q4_k_avx512(W, r, x);
      case QuantKind::Q6_K: return dot_q6_k_avx512(W, r, x);
      case QuantKind::Q5_0: return dot_q5_0_avx512(W, r, x);
      case QuantKind::Q8_0: return dot_q8_0_avx512(W, r, x);
      default: break;
    }
  if (level >= CpuLevel::Avx2) return dot_avx2(W, r, x);
#else
  (void)level;
#endif
  return dot_generic(W, r, x);
}

float block_dot_row(const Matrix& W, int64_t r, const float* x) { return block_dot_row_at(cpu_level(), W, r, x); }

}  // namespace flashmoe::cpu
