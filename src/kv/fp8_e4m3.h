// OCP FP8 E4M3 ("E4M3FN"): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
// bits; max finite ±448, subnormal step 2^-9, 0x7F / 0xFF are NaN, no
// infinities. The encoder is exact: round-to-nearest-even on the real value
// at every magnitude (subnormals included), saturating to ±448 (±inf too).
#pragma once
#include <cstdint>

namespace flashmoe::fp8 {

// The 256 decoded values, indexed by code.
const float* e4m3_table();

inline float e4m3_decode(uint8_t code) { return e4m3_table()[code]; }

// Exact encoder: NaN -> 0x7F (0xFF when the sign bit is set); |x| > 448
// (infinities included) -> ±448 (0x7E / 0xFE); -0 -> 0x80; otherwise the
// nearest representable value, ties to the even code.
uint8_t e4m3_encode(float x);

// Encodes n values as code(x[i] / scale); returns nothing, scale must be > 0.
void e4m3_encode_scaled(const float* x, int64_t n, float scale, uint8_t* out);

// The per-block scale used by the KV cache: absmax / 240, or 1 when absmax is 0.
float e4m3_block_scale(const float* x, int64_t n);

// The candidate scales of fp8 `channel` rows, absmax > 0: j = 0 is
// absmax / 240 (the block scale), j = 1..16 absmax / (224 x 2^((j-1)/16)).
constexpr int kE4m3ScaleCandidates = 17;
float e4m3_scale_candidate(float absmax, int j);
// fp8 `channel` stores its scales narrower than f32: V's as bf16 (8
// significant bits, 2 B), K's as f24 (f32 with its 8 low mantissa bits
// rounded off: 16 significant bits, 3 B). The candidates are rounded so
// before the codes are chosen, so the codes are those of the scale decoding
// will use; a rounding moves a scale by at most 2^-8 of itself (bf16;
// f24: 2^-16), against the 2^(1/16) (4.4%) steps between candidates, so
// the absmax still lands in E4M3's range (at most 428.6 x (1 + 2^-8) < 448). Why K keeps more bits:
// its codes are chosen against the queries (kv/qk_rounding.h), and on the
// side-by-side eval of docs/kv-quality.md bf16 K scales raised mean KL from
// 4.43e-4 to 6.10e-4, while bf16 V scales alone cost 4.43e-4 -> 4.71e-4.
float e4m3_scale_candidate_bf16(float absmax, int j);
float e4m3_scale_candidate_f24(float absmax, int j);
// f24: the top 24 bits of an f32 (sign, exponent, 15 stored mantissa bits),
// rounded to nearest even; for positive finite values (scales).
inline uint32_t f32_to_f24(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  u += 0x7f + ((u >> 8) & 1);
  return u >> 8;
}
inline float f24_to_f32(uint32_t h) {
  const uint32_t u = h << 8;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// The scale of fp8 `channel` rows: of the 17 scales absmax / 240 (the
// block scale) and absmax / (224 x 2^(j/16)), j = 0..15 (the absmax landing
// anywhere in the octave [224, 448) of E4M3's range: every alignment of the
// other elements' mantissas, in steps of 2^(1/16)), the one with the least
// squared error sum_i (x_i - s decode(code(x_i / s)))^2; ties go to the
// earlier (the block scale first). 1 when the absmax is 0.
// bf16: the candidates of e4m3_scale_candidate_bf16 (fp8 `channel`).
float e4m3_mse_scale(const float* x, int64_t n, bool bf16 = false);

}  // namespace flashmoe::fp8
