// The chunk layout of GGUF Q4_K / Q6_K blocks (kinds GQ_Q4_K_C32,
// GQ_Q6_K_C32 of gguf_blocks.cuh): the routed experts' blocks rearranged
// at upload so that the decode step's expert kernels (gguf_chunk_experts.cuh)
// read them the way the q4 experts are read (quant_experts.cuh): a lane
// loads one 16-byte chunk of codes for 32 consecutive weights, and their
// scale (and min) as f32, with no unpacking of scales and no per-block
// head. Why: the file's layout spreads one 32-weight sub-block over two
// nibble planes and packs its 6-bit scales three to a byte pair, so the
// readers of gguf_warp_dot.cuh spent ~330 instructions a lane per 32
// weights and the GGUF experts ran at ~0.3 TB/s (bench/NOTES-cuda.md).
//
// A block of 256 weights, chunk s = weights 32s .. 32s + 31 (s = 0..7):
//   Q4_K (192 bytes): codes of chunk s at 16 s: byte 4t + i holds weight
//     32s + 8t + i in its low nibble and 32s + 8t + 4 + i in its high one;
//     at 128 + 8 s the f32 pair (d * sc_s, dmin * m_s): w = pair.x q - pair.y.
//   Q6_K (256 bytes): the low 4 bits of the codes as Q4_K's; at 128 + 8 s
//     two words with the high 2 bits (word p: code words 2p at bits 8i + 4
//     and 8i + 6, 2p + 1 at 8i and 8i + 2, for weights 8t + i and 8t + 4 + i);
//     at 192 + 8 s the f32 scales d * sc of the chunk's two 16-weight halves:
//     w = scale (q - 32).
// The codes are the file's codes and the scales the products
// gguf_weights8 forms (same f32 arithmetic), so every weight is exactly the
// file's (BlockQuant.ChunkLayoutKeepsEveryWeight). Host-callable.
#pragma once
#include "backend/cuda/gguf_warp_dot.cuh"

namespace flashmoe::cuda {

// The chunk-layout kind of GGUF kind k, or -1 when it has none.
FM_HD int gguf_c32_kind(int k) { return k == GQ_Q4_K ? GQ_Q4_K_C32 : k == GQ_Q6_K ? GQ_Q6_K_C32 : -1; }

FM_HD void gguf_put_f32(uint8_t* o, float f) { std::memcpy(o, &f, 4); }

// Code (0..15 for Q4_K, 0..63 for Q6_K) of weight wi (0..255) of block b.
FM_HD int gguf_k_code(int k, const uint8_t* b, int wi) {
  if (k == GQ_Q4_K) {
    const int j = wi / 64, l0 = wi % 64;
    const uint8_t v = b[16 + 32 * j + l0 % 32];
    return l0 < 32 ? v & 0xF : v >> 4;
  }
  const int h = wi / 128, r = wi % 128, qq = r / 32, l = r % 32;
  const uint8_t ql = b[64 * h + (qq & 1) * 32 + l], qh = b[128 + 32 * h + l];
  return (qq >= 2 ? ql >> 4 : ql & 0xF) | (((qh >> (2 * qq)) & 3) << 4);
}

// Block b of kind k (Q4_K or Q6_K) in the chunk layout at o.
FM_HD void gguf_c32_block(int k, const uint8_t* b, uint8_t* o) {
  for (int s = 0; s < 8; ++s) {
    auto code = [&](int t, int i) { return gguf_k_code(k, b, 32 * s + 8 * t + i); };
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 4; ++i) o[16 * s + 4 * t + i] = uint8_t((code(t, i) & 0xF) | ((code(t, 4 + i) & 0xF) << 4));
    if (k == GQ_Q4_K) {
      int sc, mn;
      gguf_k_scale_min(s, b + 4, sc, mn);
      gguf_put_f32(o + 128 + 8 * s, gguf_half(b) * float(sc));
      gguf_put_f32(o + 132 + 8 * s, gguf_half(b + 2) * float(mn));
      continue;
    }
    for (int p = 0; p < 2; ++p) {
      for (int i = 0; i < 4; ++i)
        o[128 + 8 * s + 4 * p + i] = uint8_t((code(2 * p + 1, i) >> 4) | ((code(2 * p + 1, 4 + i) >> 4) << 2) |
                                             ((code(2 * p, i) >> 4) << 4) | ((code(2 * p, 4 + i) >> 4) << 6));
      // The scale of weights 32s + 16p ..: half h, sub-block 16-group 8h + p + 2 qq (as gguf_weights8).
      const int h = s / 4, qq = s % 4;
      gguf_put_f32(o + 192 + 8 * s + 4 * p, gguf_half(b + 208) * float(int8_t(b[192 + 8 * h + p + 2 * qq])));
    }
  }
}

// One lane's chunk as loaded: 16 bytes of codes, Q6_K's high bits, the scales.
struct GChunk {
  uint32_t q[4], h[2];
  float s[2];
};

// Chunk ch (0 .. cols / 32 - 1) of a row of kind k (a C32 kind) into c.
FM_HD void gchunk_load(int k, const uint8_t* row, int ch, GChunk& c) {
  const bool six = k == GQ_Q6_K_C32;
  const uint8_t* b = row + size_t(ch >> 3) * (six ? 256 : 192);
  const int s = ch & 7;
#ifdef __CUDA_ARCH__
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(b + 16 * s));
  c.q[0] = v.x, c.q[1] = v.y, c.q[2] = v.z, c.q[3] = v.w;
  if (six) {
    const uint2 h = __ldg(reinterpret_cast<const uint2*>(b + 128 + 8 * s));
    c.h[0] = h.x, c.h[1] = h.y;
  }
  const float2 f = __ldg(reinterpret_cast<const float2*>(b + (six ? 192 : 128) + 8 * s));
  c.s[0] = f.x, c.s[1] = f.y;
#else
  std::memcpy(c.q, b + 16 * s, 16);
  if (six) std::memcpy(c.h, b + 128 + 8 * s, 8);
  std::memcpy(c.s, b + (six ? 192 : 128) + 8 * s, 8);
#endif
}

// Byte I of w minus off, as a float, exactly (a byte permute under the
// exponent of 2^23 and one subtraction on the device: no conversion).
template <int I>
FM_HD float gchunk_byte(uint32_t w, float off) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | I)) - (8388608.0f + off);
#else
  return float(int((w >> (8 * I)) & 0xFFu)) - off;
#endif
}

// sum over i of (byte i of lo - off) a[i] + (byte i of hi - off) b[i].
FM_HD float gchunk_word(uint32_t lo, uint32_t hi, const float* a, const float* b, float off) {
  float u = gchunk_byte<0>(lo, off) * a[0], v = gchunk_byte<0>(hi, off) * b[0];
  u = fmaf(gchunk_byte<1>(lo, off), a[1], u), v = fmaf(gchunk_byte<1>(hi, off), b[1], v);
  u = fmaf(gchunk_byte<2>(lo, off), a[2], u), v = fmaf(gchunk_byte<2>(hi, off), b[2], v);
  u = fmaf(gchunk_byte<3>(lo, off), a[3], u), v = fmaf(gchunk_byte<3>(hi, off), b[3], v);
  return u + v;
}

// The dot of chunk c with x staged chunk-major as stage_chunks<4> writes it
// (quant_experts.cuh): float4 i (columns 4i .. 4i + 3) of the chunk at
// xq + 4 i stride, the sums of its four 8-column pieces at s8[p * stride]
// (Q4_K's min term). SIX: Q6_K (else Q4_K) in the chunk layout.
template <bool SIX>
FM_HD float gchunk_dot_of(const GChunk& c, const float* xq, const float* s8, int stride) {
  float acc0 = 0.f, acc1 = 0.f;  // Q6_K: the chunk's two 16-weight halves
FM_UNROLL
  for (int t = 0; t < 4; ++t) {
    float a[4], b[4];
#ifdef __CUDA_ARCH__
    const float4 x0 = *reinterpret_cast<const float4*>(xq + 4 * (2 * t) * stride);
    const float4 x1 = *reinterpret_cast<const float4*>(xq + 4 * (2 * t + 1) * stride);
    a[0] = x0.x, a[1] = x0.y, a[2] = x0.z, a[3] = x0.w, b[0] = x1.x, b[1] = x1.y, b[2] = x1.z, b[3] = x1.w;
#else
    for (int i = 0; i < 4; ++i) a[i] = xq[4 * (2 * t) * stride + i], b[i] = xq[4 * (2 * t + 1) * stride + i];
#endif
    uint32_t lo = c.q[t] & 0x0F0F0F0Fu, hi = (c.q[t] >> 4) & 0x0F0F0F0Fu;
    if (SIX) {
      const uint32_t hb = (t & 1) ? c.h[t >> 1] << 4 : c.h[t >> 1];
      lo |= hb & 0x30303030u;
      hi |= (hb >> 2) & 0x30303030u;
    }
    const float d = gchunk_word(lo, hi, a, b, SIX ? 32.0f : 0.0f);
    if (SIX && t >= 2) acc1 += d;
    else acc0 += d;
  }
  if (SIX) return c.s[0] * acc0 + c.s[1] * acc1;
  const float xs = (s8[0] + s8[stride]) + (s8[2 * stride] + s8[3 * stride]);
  return c.s[0] * acc0 - c.s[1] * xs;
}
// The same for a chunk of kind k (GQ_Q4_K_C32 or GQ_Q6_K_C32).
FM_HD float gchunk_dot(int k, const GChunk& c, const float* xq, const float* s8, int stride) {
  return k == GQ_Q6_K_C32 ? gchunk_dot_of<true>(c, xq, s8, stride) : gchunk_dot_of<false>(c, xq, s8, stride);
}

}  // namespace flashmoe::cuda
