// ggml's block formats (the GGUF kinds of QuantKind, layouts in
// core/block_quant.h) read on the device as stored: 8 consecutive weights
// of a row at a time, expanded in registers from the block that holds them
// (scales, mins, high bits, the IQ4 table) and never written back wider.
// The values are exactly ggml's dequantisation, computed in the same order
// as the CPU's block kernels (core/block_quant.cpp), so CUDA and CPU see the
// same weights. Host-callable too: tests/block_quant_test.cpp checks these
// readers against the CPU's block_dequant without a GPU.
#pragma once
#include <cstdint>
#include <cstring>

#include "backend/cuda/gguf_dense_layout.cuh"
#include "core/matrix.h"

#ifdef __CUDACC__
#define FM_HD __host__ __device__ __forceinline__
#else
#define FM_HD inline
#endif

namespace flashmoe::cuda {

// QuantKind as the kernels take it (a plain int: kernel arguments, switches).
enum : int {
  GQ_Q8_0 = int(QuantKind::Q8_0), GQ_Q4_0 = int(QuantKind::Q4_0), GQ_Q4_1 = int(QuantKind::Q4_1),
  GQ_Q5_0 = int(QuantKind::Q5_0), GQ_Q5_1 = int(QuantKind::Q5_1), GQ_Q4_K = int(QuantKind::Q4_K),
  GQ_Q5_K = int(QuantKind::Q5_K), GQ_Q6_K = int(QuantKind::Q6_K), GQ_IQ4_NL = int(QuantKind::IQ4_NL),
  GQ_IQ4_XS = int(QuantKind::IQ4_XS),
};
// Q4_K / Q6_K blocks in the chunk layout the decode step's expert kernels
// read (gguf_chunks.cuh, rearranged at upload; never in a file): per 256
// weights, the codes of each 32 in one 16-byte chunk, the scales as f32.
// Values between QuantKind's and 32 (from 32 on: branch gguf-dense's kinds).
enum : int { GQ_Q4_K_C32 = 16, GQ_Q6_K_C32 = 17 };
static_assert(int(GQ_Q4_K_C32) > int(GQ_IQ4_XS), "the chunk kinds are not QuantKinds");

// Repacked kinds (kGDense + a file kind: dense matrices repacked at upload,
// gguf_dense_layout.cuh) are read through the same three functions.
FM_HD int gguf_block_elems(int k) {
  return gdense_kind(k) || k == GQ_Q4_K || k == GQ_Q5_K || k == GQ_Q6_K || k == GQ_IQ4_XS || k == GQ_Q4_K_C32 ||
                 k == GQ_Q6_K_C32
             ? 256
             : 32;
}
FM_HD int gguf_block_bytes(int k) {
  if (gdense_kind(k)) return gdense_block_bytes(k);
  switch (k) {
    case GQ_Q8_0: return 34;
    case GQ_Q4_0: return 18;
    case GQ_Q4_1: return 20;
    case GQ_Q5_0: return 22;
    case GQ_Q5_1: return 24;
    case GQ_IQ4_NL: return 18;
    case GQ_Q4_K: return 144;
    case GQ_Q5_K: return 176;
    case GQ_Q6_K: return 210;
    case GQ_Q4_K_C32: return 192;
    case GQ_Q6_K_C32: return 256;
    default: return 136;  // IQ4_XS
  }
}

// f16 bits -> f32, exact (as core/block_quant.cpp's half()): the exponent
// and mantissa shifted into an f32 are the value times 2^-112.
FM_HD float gguf_half(const uint8_t* p) {
  const uint32_t h = uint32_t(p[0]) | (uint32_t(p[1]) << 8);
  const uint32_t em = h & 0x7fffu;
  uint32_t bits = em << 13;
  float f;
  if (em >= 0x7c00u) {
    bits |= 0x7f800000u;
    f = bits_to_f32(bits);
  } else {
    f = bits_to_f32(bits) * 0x1p112f;
  }
  return (h & 0x8000u) ? -f : f;
}

// The little-endian word at p (4-byte aligned).
FM_HD uint32_t gguf_word(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}

FM_HD int gguf_iq4(int q) {
  // The 16 levels of IQ4_NL / IQ4_XS (a switch: no table in constant memory to share across units).
  switch (q) {
    case 0: return -127; case 1: return -104; case 2: return -83; case 3: return -65;
    case 4: return -49; case 5: return -35; case 6: return -22; case 7: return -10;
    case 8: return 1; case 9: return 13; case 10: return 25; case 11: return 38;
    case 12: return 53; case 13: return 69; case 14: return 89; default: return 113;
  }
}

// Nibble j (0..31) of a 32-weight run whose 16 bytes q hold weight j in the
// low nibble of q[j] (j < 16) and in the high nibble of q[j - 16].
FM_HD int gguf_nib32(const uint8_t* q, int j) { return j < 16 ? q[j] & 0xF : q[j - 16] >> 4; }

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block.
FM_HD void gguf_k_scale_min(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Weights c .. c+7 (c a multiple of 8) of a row of kind k starting at row.
FM_HD void gguf_weights8(int k, const uint8_t* row, int c, float* w) {
  if (gdense_kind(k)) return gdense_weights8(k, row, c, w);
  const int be = gguf_block_elems(k);
  const uint8_t* b = row + size_t(c / be) * gguf_block_bytes(k);
  const int i0 = c % be;
  switch (k) {
    case GQ_Q8_0: {
      const float d = gguf_half(b);
      for (int i = 0; i < 8; ++i) w[i] = float(int8_t(b[2 + i0 + i])) * d;
      return;
    }
    case GQ_Q4_0: {
      const float d = gguf_half(b);
      for (int i = 0; i < 8; ++i) w[i] = float(gguf_nib32(b + 2, i0 + i) - 8) * d;
      return;
    }
    case GQ_Q4_1: {
      const float d = gguf_half(b), m = gguf_half(b + 2);
      for (int i = 0; i < 8; ++i) w[i] = float(gguf_nib32(b + 4, i0 + i)) * d + m;
      return;
    }
    case GQ_Q5_0:
    case GQ_Q5_1: {
      const bool mn = k == GQ_Q5_1;
      const float d = gguf_half(b), m = mn ? gguf_half(b + 2) : 0.0f;
      const uint8_t* qh = b + (mn ? 4 : 2);
      const uint8_t* q = qh + 4;
      for (int i = 0; i < 8; ++i) {
        const int j = i0 + i;
        const int x = gguf_nib32(q, j) | (((qh[j / 8] >> (j % 8)) & 1) << 4);
        w[i] = mn ? float(x) * d + m : float(x - 16) * d;
      }
      return;
    }
    case GQ_IQ4_NL: {
      const float d = gguf_half(b);
      for (int i = 0; i < 8; ++i) w[i] = d * float(gguf_iq4(gguf_nib32(b + 2, i0 + i)));
      return;
    }
    case GQ_Q4_K:
    case GQ_Q5_K: {
      const bool five = k == GQ_Q5_K;
      const int j = i0 / 64, l0 = i0 % 64, is = 2 * j + (l0 >= 32 ? 1 : 0), l = l0 % 32;
      int sc, mn;
      gguf_k_scale_min(is, b + 4, sc, mn);
      const float d1 = gguf_half(b) * float(sc), mm = gguf_half(b + 2) * float(mn);
      const uint8_t* q = b + (five ? 48 : 16) + 32 * j + l;
      const uint8_t* qh = b + 16 + l;
      uint8_t qb[8];
#ifdef __CUDA_ARCH__
      // One 8-byte load of the 8 weights' nibble bytes where aligned (always,
      // for rows uploaded by upload.cu: 16-byte aligned parts of 144-byte blocks).
      if ((reinterpret_cast<uintptr_t>(q) & 7) == 0) {
        const uint2 v = *reinterpret_cast<const uint2*>(q);
        for (int i = 0; i < 4; ++i) qb[i] = uint8_t(v.x >> (8 * i)), qb[4 + i] = uint8_t(v.y >> (8 * i));
      } else
#endif
        for (int i = 0; i < 8; ++i) qb[i] = q[i];
      for (int i = 0; i < 8; ++i) {
        const int h = five ? ((qh[i] >> is) & 1) << 4 : 0;
        w[i] = d1 * float((l0 < 32 ? (qb[i] & 0xF) : (qb[i] >> 4)) + h) - mm;
      }
      return;
    }
    case GQ_Q6_K: {
      const int h = i0 / 128, r = i0 % 128, qq = r / 32, l = r % 32;
      const float d = gguf_half(b + 208);
      const float ds = d * float(int8_t(b[192 + 8 * h + l / 16 + 2 * qq]));
      const uint8_t* ql = b + 64 * h + (qq & 1) * 32 + l;
      const uint8_t* qh = b + 128 + 32 * h + l;
      for (int i = 0; i < 8; ++i) {
        const int lo = qq >= 2 ? ql[i] >> 4 : ql[i] & 0xF;
        const int q = (lo | (((qh[i] >> (2 * qq)) & 3) << 4)) - 32;
        w[i] = ds * float(q);
      }
      return;
    }
    case GQ_Q4_K_C32:
    case GQ_Q6_K_C32: {
      // Chunk s (the block's 32 weights 32s .. 32s + 31) at 16 s, word t of
      // it: byte i holds weight 32s + 8t + i in its low nibble and + 4 + i in
      // its high nibble (gguf_chunks.cuh). The scales are the products the
      // cases above form, computed at upload by the same arithmetic.
      const int s = i0 / 32, t = (i0 % 32) / 8;
      const uint32_t q = gguf_word(b + 16 * s + 4 * t);
      if (k == GQ_Q4_K_C32) {
        const float d1 = bits_to_f32(gguf_word(b + 128 + 8 * s)), mm = bits_to_f32(gguf_word(b + 132 + 8 * s));
        for (int i = 0; i < 4; ++i) {
          w[i] = d1 * float((q >> (8 * i)) & 0xF) - mm;
          w[4 + i] = d1 * float((q >> (8 * i + 4)) & 0xF) - mm;
        }
        return;
      }
      // Q6_K: the high 2 bits of word t's codes in the word at 128 + 8 s +
      // 4 (t / 2), at bits 8i + 4 and 8i + 6 (t even) or 8i and 8i + 2 (t odd);
      // one f32 scale per 16 weights.
      const uint32_t h = gguf_word(b + 128 + 8 * s + 4 * (t / 2)) >> ((t & 1) ? 0 : 4);
      const float ds = bits_to_f32(gguf_word(b + 192 + 8 * s + 4 * (t / 2)));
      for (int i = 0; i < 4; ++i) {
        w[i] = ds * float(int(((q >> (8 * i)) & 0xF) | (((h >> (8 * i)) & 3) << 4)) - 32);
        w[4 + i] = ds * float(int(((q >> (8 * i + 4)) & 0xF) | (((h >> (8 * i + 2)) & 3) << 4)) - 32);
      }
      return;
    }
    default: {  // IQ4_XS
      const int ib = i0 / 32, j0 = i0 % 32;
      const uint32_t sh = uint32_t(b[2]) | (uint32_t(b[3]) << 8);
      const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
      const float dl = gguf_half(b) * float(ls - 32);
      for (int i = 0; i < 8; ++i) w[i] = dl * float(gguf_iq4(gguf_nib32(b + 8 + 16 * ib, j0 + i)));
      return;
    }
  }
}

// Bytes per row of kind k with cols columns.
FM_HD size_t gguf_row_bytes(int k, int cols) { return size_t(cols / gguf_block_elems(k)) * gguf_block_bytes(k); }

// The parts of a matrix in GGUF block formats, stacked row-wise (q, k, v of
// a projection may each have their own kind: a Q4_K_M file keeps v in
// Q6_K): part i holds rows [row0[i], row0[i + 1]) of kind kind[i] (a
// QuantKind), starting off[i] bytes from the matrix's base. Rows of part i
// are gguf_row_bytes(kind[i], cols) bytes each. n == 0: not a GGUF matrix.
constexpr int kGParts = 4;
struct GMat {
  int n = 0;
  int row0[kGParts + 1] = {};
  int kind[kGParts] = {};
  size_t off[kGParts] = {};
};

// The part of g holding row r.
FM_HD int gmat_part(const GMat& g, int r) {
  int i = 0;
  while (i + 1 < g.n && r >= g.row0[i + 1]) ++i;
  return i;
}
// Row r of g (base: the matrix's first byte), its kind in kind.
FM_HD const uint8_t* gmat_row(const GMat& g, const void* base, int cols, int r, int& kind) {
  const int i = gmat_part(g, r);
  kind = g.kind[i];
  return static_cast<const uint8_t*>(base) + g.off[i] + size_t(r - g.row0[i]) * gguf_row_bytes(kind, cols);
}

}  // namespace flashmoe::cuda
