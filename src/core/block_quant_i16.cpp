#include "core/block_quant_i16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "core/x86_hsum.h"
#define FLASHMOE_X86 1
// GCC 12's AVX-512 intrinsics trip -Wuninitialized (see simd_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

namespace flashmoe::cpu {

namespace {

constexpr float kCodeMax = 32767.0f;
constexpr float kLoSteps = 65536.0f;  // low codes per high code step

// Columns sharing one activation scale: 256 (a K-quant block) when the row
// is whole blocks of 256, else 32. A K-quant row kernel then multiplies a
// whole block's integer sums by one factor (the sub-block scales go into
// the weights as 16-bit integers) instead of converting and scaling every
// sub-block's sums; the codes stay within 2^-32 of the group's largest value.
inline int64_t scale_group(int64_t cols) { return cols % 256 == 0 ? 256 : 32; }

void quantize_scalar(const float* x, int64_t cols, Int16Activations& out) {
  const int64_t group = scale_group(cols);
  for (int64_t g = 0; g < cols / group; ++g) {
    float amax = 0;
    for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[g * group + i]));
    const float inv = amax > 0 ? kCodeMax / amax : 0.0f;
    for (int64_t b = g * group / 32; b < (g + 1) * group / 32; ++b) {
      const float* xb = x + 32 * b;
      float sum = 0;
      for (int i = 0; i < 32; ++i) sum += xb[i];
      int16_t* c = out.code.data() + 64 * b;
      // Clamped as packs saturates (only a NaN or an infinity gets there).
      for (int i = 0; i < 32; ++i) {
        const long hi = std::clamp(std::lrint(xb[i] * inv), -32768L, 32767L);
        c[(i % 2) * 16 + i / 2] = int16_t(hi);
        const long lo = std::lrint(std::fma(xb[i], inv, -float(hi)) * kLoSteps);
        c[32 + (i % 2) * 16 + i / 2] = int16_t(std::clamp(lo, -32768L, 32767L));
      }
      out.scale[size_t(b)] = amax / kCodeMax;
      out.sum[size_t(b)] = sum;
    }
  }
}

#ifdef FLASHMOE_X86
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
  const int64_t group = scale_group(cols);
  for (int64_t g = 0; g < cols / group; ++g) {
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; i += 8)
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    const float amax = hmax(m);
    const __m256 inv = _mm256_set1_ps(amax > 0 ? kCodeMax / amax : 0.0f);
    for (int64_t b = g * group / 32; b < (g + 1) * group / 32; ++b) {
      const float* xb = x + 32 * b;
      const __m256 f[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                           _mm256_loadu_ps(xb + 24)};
      int16_t* c = out.code.data() + 64 * b;
      __m256i hi[4], lo[4];
      for (int k = 0; k < 4; ++k) {
        hi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(f[k], inv));
        const __m256 rest = _mm256_fmsub_ps(f[k], inv, _mm256_cvtepi32_ps(hi[k]));
        lo[k] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(kLoSteps)));
      }
      store_deinterleaved(hi, c, order);
      store_deinterleaved(lo, c + 32, order);
      out.scale[size_t(b)] = amax / kCodeMax;
      out.sum[size_t(b)] = hsum8(_mm256_add_ps(_mm256_add_ps(f[0], f[1]), _mm256_add_ps(f[2], f[3])));
    }
  }
}

AVX2_FN inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
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

namespace avx2 {
#define I16_FN AVX2_FN
#define I16_VNNI 0
#include "core/block_quant_i16_kernels.inc"
#undef I16_FN
#undef I16_VNNI
}  // namespace avx2

namespace vnni {
#define I16_FN VNNI_FN
#define I16_VNNI 1
#include "core/block_quant_i16_kernels.inc"
#undef I16_FN
#undef I16_VNNI

// The K-quant kernels at this level, 512 bits wide. The activations share
// one scale per 256 columns (scale_group), so a block's sub-block (Q4_K) or
// 16-column (Q6_K) scales are multiplied into the weights as 16-bit
// integers and the whole block's products summed in int32 lanes: one
// conversion and one scaling per block instead of per 32 weights. A
// block's 32 weights of one activation block fill a zmm as the codes are
// stored (16 even columns, then 16 odd ones), so one vpdpwssd covers 32
// weights. Bounds: a Q4_K weight times its scale is at most 15 * 63 = 945,
// a Q6_K one |q - 32| * |sc| <= 32 * 128 = 4096; a code is at most 32768 in
// size; each int32 lane of an accumulator takes 8 products a block, so at
// most 8 * 4096 * 32768 = 2^30: exact. Partial sums come back folded to 8
// lanes for rows<>'s four-row reduction.

// One block of 32 as one zmm of 16-bit weights (even columns, then odd
// ones, as the codes are stored) against both codes: sum of w * (hi + lo /
// 65536) in 16 fp32 lanes.
VNNI_FN inline __m512 dot32_zmm(__m512i w, const int16_t* code) {
  const __m512i h = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(code));
  const __m512i l = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(code + 32));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), _mm512_set1_ps(1.0f / kLoSteps), _mm512_cvtepi32_ps(h));
}
// 16 partial sums folded to the 8 that rows<> reduces.
VNNI_FN inline __m256 fold(__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }

// k_scales_mins in registers (the block's 12 bytes and the next 4, unused,
// as 32-bit lanes u0..u3): lanes of u0 & 0x3f3f3f3f, (u2 & 0x0f0f0f0f) |
// (bits 6-7 of u0's bytes) << 4, u1 & 0x3f3f3f3f, (u2 >> 4 & 0x0f0f0f0f) |
// (bits 6-7 of u1's bytes) << 4. Bytes assembled on the stack and loaded
// back as a vector put a failed store forwarding on every row's path.
VNNI_FN inline __m128i k_scales_mins_sse(const uint8_t* s) {
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                   _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(lo, hi);
}

// Q4_K: the pair p's 32 bytes in both halves of a zmm; per 16-bit lane a
// variable shift picks the even column's nibble (lanes 0-15) or the odd
// one's (lanes 16-31): shifts 0 / 8 for the low nibbles (sub-block 2p), 4 /
// 12 for the high ones (sub-block 2p + 1).
VNNI_FN inline __m256 dot_q4_k_zmm(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  const __m512i m4 = _mm512_set1_epi16(0x000F);
  const __m512i sh_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(8), 1);
  const __m512i sh_hi = _mm512_add_epi16(sh_lo, _mm512_set1_epi16(4));
  // pick[j]: every 16-bit lane from lane j (sub-block j's scale).
  __m512i pick[8];
  for (int j = 0; j < 8; ++j) pick[j] = _mm512_set1_epi16(short(j));
  __m512 acc = _mm512_setzero_ps();
  __m256 amin = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 144 * b;
    const __m128i smv = k_scales_mins_sse(blk + 4);
    const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(smv));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8)));
    amin = _mm256_fmadd_ps(_mm256_set1_ps(half(blk + 2)), _mm256_mul_ps(mins, _mm256_loadu_ps(x.sum.data() + 8 * b)),
                           amin);
    const int16_t* code = x.code.data() + 512 * b;
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p)));
      const __m512i w0 = _mm512_mullo_epi16(_mm512_and_si512(_mm512_srlv_epi16(v, sh_lo), m4),
                                            _mm512_permutexvar_epi16(pick[2 * p], s16));
      const __m512i w1 = _mm512_mullo_epi16(_mm512_and_si512(_mm512_srlv_epi16(v, sh_hi), m4),
                                            _mm512_permutexvar_epi16(pick[2 * p + 1], s16));
      const int16_t* c = code + 128 * p;
      h0 = _mm512_dpwssd_epi32(h0, w0, _mm512_loadu_si512(c));
      l0 = _mm512_dpwssd_epi32(l0, w0, _mm512_loadu_si512(c + 32));
      h1 = _mm512_dpwssd_epi32(h1, w1, _mm512_loadu_si512(c + 64));
      l1 = _mm512_dpwssd_epi32(l1, w1, _mm512_loadu_si512(c + 96));
    }
    const __m512 hl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(l0, l1)), _mm512_set1_ps(1.0f / kLoSteps),
                                      _mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)));
    acc = _mm512_fmadd_ps(hl, _mm512_set1_ps(half(blk) * x.scale[size_t(8 * b)]), acc);
  }
  return _mm256_sub_ps(fold(acc), amin);
}

// Q8_0, one block per zmm: its 32 bytes in both halves, the even columns
// sign-extended from the low byte of each 16-bit lane (shift left 8, then
// arithmetic right 8) in lanes 0-15, the odd ones from the high byte
// (arithmetic right 8) in lanes 16-31; one vpdpwssd per code.
VNNI_FN inline __m256 dot_q8_0_zmm(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(8), _mm256_setzero_si256(), 1);
  const __m512i sar = _mm512_set1_epi16(8);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 34 * b;
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
    const __m512i w = _mm512_srav_epi16(_mm512_sllv_epi16(v, shl), sar);
    const __m512 p = dot32_zmm(w, x.code.data() + 64 * b);
    const __m512 f = _mm512_set1_ps(half(blk) * x.scale[size_t(b)]);
    if (b % 2) a1 = _mm512_fmadd_ps(p, f, a1);
    else a0 = _mm512_fmadd_ps(p, f, a0);
  }
  return fold(_mm512_add_ps(a0, a1));
}

// Q5_0, one block per zmm: the 16 nibble bytes as 8 16-bit lanes in each
// quarter of a zmm, a variable shift of 0 / 4 / 8 / 12 bits per quarter
// giving lanes 0-7 the even columns 0-14 (low nibbles of the even bytes),
// 8-15 the even columns 16-30 (their high nibbles), 16-23 and 24-31 the
// odd columns likewise; the fifth bit of column c is bit c of qh, tested
// per lane against qh's low or high half (columns below 16 or not).
VNNI_FN inline __m256 dot_q5_0_zmm(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  const __m512i m4 = _mm512_set1_epi16(0x000F), sixteen = _mm512_set1_epi16(16);
  const __m512i sh = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_setzero_si256(), _mm_set1_epi16(4), 1)),
      _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(8)), _mm_set1_epi16(12), 1), 1);
  // Lane L's column: 2L (L < 16) or 2(L - 16) + 1; its bit within qh's half.
  alignas(64) int16_t bit[32];
  for (int l = 0; l < 32; ++l) bit[l] = int16_t(1u << ((l < 16 ? 2 * l : 2 * (l - 16) + 1) % 16));
  const __m512i bits = _mm512_load_si512(bit);
  constexpr __mmask32 kHigh = 0xFF00FF00u;  // lanes of columns 16-31
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 22 * b;
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    const __m512i q = _mm512_and_si512(
        _mm512_srlv_epi16(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6))), sh), m4);
    const __m512i h = _mm512_mask_blend_epi16(kHigh, _mm512_set1_epi16(short(qh & 0xFFFF)), _mm512_set1_epi16(short(qh >> 16)));
    // (q | bit << 4) - 16: q where the bit is set, q - 16 elsewhere.
    const __m512i w = _mm512_mask_sub_epi16(q, _mm512_testn_epi16_mask(h, bits), q, sixteen);
    const __m512 p = dot32_zmm(w, x.code.data() + 64 * b);
    const __m512 f = _mm512_set1_ps(half(blk) * x.scale[size_t(b)]);
    if (b % 2) a1 = _mm512_fmadd_ps(p, f, a1);
    else a0 = _mm512_fmadd_ps(p, f, a0);
  }
  return fold(_mm512_add_ps(a0, a1));
}

// Q6_K: the 6-bit values assembled per run of 32 as in dot_q6_k, split
// into the even / odd 16-bit lanes of a zmm, centred and multiplied by
// their 16-column scales (lanes 0-7 and 16-23: columns 0-15 of the run,
// scale 2k; the others scale 2k + 1).
VNNI_FN inline __m256 dot_q6_k_zmm(const uint8_t* row, int64_t nb, const Int16Activations& x) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), lo8 = _mm256_set1_epi16(0x00FF);
  const __m512i off = _mm512_set1_epi16(32);
  __m512i pick[4];
  for (int k = 0; k < 4; ++k) {
    const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(short(2 * k))),
                                               _mm_set1_epi16(short(2 * k + 1)), 1);
    pick[k] = _mm512_inserti64x4(_mm512_castsi256_si512(ab), ab, 1);
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + 210 * b;
    const int16_t* code = x.code.data() + 512 * b;
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int n = 0; n < 2; ++n) {
      const __m512i sc = _mm512_castsi128_si512(
          _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * n))));
      const uint8_t* ql = blk + 64 * n;
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * n));
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(a0, m4), q6_high<0>(h, m2)),
          _mm256_or_si256(_mm256_and_si256(a1, m4), q6_high<2>(h, m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a0, 4), m4), q6_high<4>(h, m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a1, 4), m4), q6_high<6>(h, m2)),
      };
      for (int k = 0; k < 4; ++k) {
        const __m512i eo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q[k], lo8)),
                                              _mm256_srli_epi16(q[k], 8), 1);
        const __m512i w = _mm512_mullo_epi16(_mm512_sub_epi16(eo, off), _mm512_permutexvar_epi16(pick[k], sc));
        const int16_t* c = code + 256 * n + 64 * k;
        if (k % 2) {
          h1 = _mm512_dpwssd_epi32(h1, w, _mm512_loadu_si512(c));
          l1 = _mm512_dpwssd_epi32(l1, w, _mm512_loadu_si512(c + 32));
        } else {
          h0 = _mm512_dpwssd_epi32(h0, w, _mm512_loadu_si512(c));
          l0 = _mm512_dpwssd_epi32(l0, w, _mm512_loadu_si512(c + 32));
        }
      }
    }
    // Each accumulator within 2^30, their sum possibly not: added in fp32.
    const __m512 hs = _mm512_add_ps(_mm512_cvtepi32_ps(h0), _mm512_cvtepi32_ps(h1));
    const __m512 ls = _mm512_add_ps(_mm512_cvtepi32_ps(l0), _mm512_cvtepi32_ps(l1));
    acc = _mm512_fmadd_ps(_mm512_fmadd_ps(ls, _mm512_set1_ps(1.0f / kLoSteps), hs),
                          _mm512_set1_ps(half(blk + 208) * x.scale[size_t(8 * b)]), acc);
  }
  return fold(acc);
}
}  // namespace vnni
#endif

}  // namespace

void quantize_activations_i16(const float* x, int64_t cols, Int16Activations& out) {
  quantize_activations_i16_at(cpu_level(), x, cols, out);
}

void quantize_activations_i16_at(CpuLevel level, const float* x, int64_t cols, Int16Activations& out) {
  if (cols <= 0 || cols % 32 != 0)
    fail("quantize_activations_i16: " + std::to_string(cols) + " columns is not a whole number of blocks of 32");
  out.cols = cols;
  out.code.resize(size_t(2 * cols));
  out.scale.resize(size_t(cols / 32));
  out.sum.resize(size_t(cols / 32));
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx2) return quantize_avx2(x, cols, out);
#endif
  (void)level;
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

}  // namespace

void block_dot_rows_i16_at(CpuLevel level, const Matrix& W, int64_t r0, int64_t r1, const Int16Activations& x,
                           float* y) {
  check_i16(level, W, x);
#ifdef FLASHMOE_X86
  if (level >= CpuLevel::Avx512Vnni) switch (W.quant) {
      case QuantKind::Q8_0: return vnni::rows<vnni::dot_q8_0_zmm>(W, r0, r1, x, y);
      case QuantKind::Q4_K: return vnni::rows<vnni::dot_q4_k_zmm>(W, r0, r1, x, y);
      case QuantKind::Q5_0: return vnni::rows<vnni::dot_q5_0_zmm>(W, r0, r1, x, y);
      default: return vnni::rows<vnni::dot_q6_k_zmm>(W, r0, r1, x, y);
    }
  switch (W.quant) {
    case QuantKind::Q8_0: return avx2::rows<avx2::dot_q8_0>(W, r0, r1, x, y);
    case QuantKind::Q4_K: return avx2::rows<avx2::dot_q4_k>(W, r0, r1, x, y);
    case QuantKind::Q5_0: return avx2::rows<avx2::dot_q5_0>(W, r0, r1, x, y);
    default: return avx2::rows<avx2::dot_q6_k>(W, r0, r1, x, y);
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
