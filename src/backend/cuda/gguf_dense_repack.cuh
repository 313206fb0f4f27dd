// The upload's repacking of a dense GGUF matrix into the decode matvec's
// layout (gguf_dense_layout.cuh): per group of 32 columns the file's codes
// (as unsigned integers) and the pair of floats the weights are made of,
// written into repacked blocks of 256 columns. Host code (upload.cu, the op
// checks, tests/block_quant_test.cpp).
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cuda/gguf_blocks.cuh"
#include "backend/cuda/gguf_dense_layout.cuh"

namespace flashmoe::cuda {

// Whether rows of file kind k with cols columns can be repacked.
inline bool gdense_repackable(int k, int cols) {
  const bool kind = k == GQ_Q8_0 || k == GQ_Q4_0 || k == GQ_Q4_1 || k == GQ_Q5_0 || k == GQ_Q5_1 || k == GQ_Q4_K ||
                    k == GQ_Q5_K || k == GQ_Q6_K;
  return kind && cols % 256 == 0;
}

// Group j (0..7) of the 256 columns at file row bytes src (kind k): the 32
// unsigned codes u and the pair (p0, p1) of gguf_dense_layout.cuh.
inline void gdense_file_group(int k, const uint8_t* src, int j, uint8_t* u, float& p0, float& p1) {
  if (gguf_block_elems(k) == 32) {  // 8 blocks of 32: group j is block j
    const uint8_t* b = src + size_t(j) * gguf_block_bytes(k);
    const float d = gguf_half(b);
    p0 = p1 = d;
    switch (k) {
      case GQ_Q8_0:
        for (int i = 0; i < 32; ++i) u[i] = uint8_t(int(int8_t(b[2 + i])) + 128);
        return;
      case GQ_Q4_0:
        for (int i = 0; i < 32; ++i) u[i] = uint8_t(gguf_nib32(b + 2, i));
        return;
      case GQ_Q4_1:
        p1 = -gguf_half(b + 2);
        for (int i = 0; i < 32; ++i) u[i] = uint8_t(gguf_nib32(b + 4, i));
        return;
      default: {  // Q5_0, Q5_1
        const bool mn = k == GQ_Q5_1;
        if (mn) p1 = -gguf_half(b + 2);
        const uint8_t* qh = b + (mn ? 4 : 2);
        for (int i = 0; i < 32; ++i) u[i] = uint8_t(gguf_nib32(qh + 4, i) | (((qh[i / 8] >> (i % 8)) & 1) << 4));
        return;
      }
    }
  }
  if (k == GQ_Q6_K) {
    const int h = j / 4, qq = j % 4;
    const float d = gguf_half(src + 208);
    p0 = d * float(int8_t(src[192 + 8 * h + 2 * qq]));
    p1 = d * float(int8_t(src[192 + 8 * h + 2 * qq + 1]));
    for (int l = 0; l < 32; ++l) {
      const uint8_t ql = src[64 * h + (qq & 1) * 32 + l], qh = src[128 + 32 * h + l];
      u[l] = uint8_t((qq >= 2 ? ql >> 4 : ql & 0xF) | (((qh >> (2 * qq)) & 3) << 4));
    }
    return;
  }
  // Q4_K, Q5_K: sub-block j.
  const bool five = k == GQ_Q5_K;
  int sc, mn;
  gguf_k_scale_min(j, src + 4, sc, mn);
  p0 = gguf_half(src) * float(sc);
  p1 = gguf_half(src + 2) * float(mn);
  const uint8_t* q = src + (five ? 48 : 16) + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) {
    const int h = five ? ((src[16 + l] >> j) & 1) << 4 : 0;
    u[l] = uint8_t(((j & 1) ? q[l] >> 4 : q[l] & 0xF) | h);
  }
}

// Rows [0, rows) of file kind k (cols columns, src the file's bytes) as
// repacked rows into dst (rows * gguf_row_bytes(kGDense + k, cols) bytes).
inline void gdense_repack_rows(int k, const uint8_t* src, int rows, int cols, uint8_t* dst) {
  const int rk = kGDense + k, bb = gdense_block_bytes(rk), h = gdense_info(rk).h;
  const size_t sb = gguf_row_bytes(k, 256);  // file bytes of 256 columns
  for (size_t n = 0, blocks = size_t(rows) * (cols / 256); n < blocks; ++n) {
    const uint8_t* s = src + n * sb;
    uint8_t* b = dst + n * size_t(bb);
    std::memset(b, 0, size_t(bb));
    for (int j = 0; j < 8; ++j) {
      uint8_t u[32];
      float pr[2];
      gdense_file_group(k, s, j, u, pr[0], pr[1]);
      std::memcpy(b + 128 + 32 * h + 8 * j, pr, 8);
      for (int c = 0; c < 32; ++c) {
        // Column c is byte b of set st (c = 4 st + b): nibble st % 2 of
        // byte b of low word st / 2; high bits at p of byte b of word st / per.
        const int st = c / 4, by = c % 4;
        b[16 * j + 4 * (st / 2) + by] |= uint8_t((u[c] & 0xF) << (4 * (st % 2)));
        if (h) {
          const int per = 8 / h, p = h * (st % per);
          uint8_t* w = b + 128 + 4 * h * j + 4 * (st / per);
          w[by] |= uint8_t((u[c] >> 4) << p);
        }
      }
    }
  }
}

// The parts of a matrix stacked as the upload places them (each part on a
// 16-byte boundary), repacked or in the file's blocks; bytes: the total.
inline GMat gmat_stack(const std::vector<Matrix>& parts, bool repack, size_t& bytes) {
  GMat g;
  const int cols = int(parts.at(0).cols);
  size_t off = 0;
  int rows = 0;
  for (const Matrix& p : parts) {
    g.row0[g.n] = rows;
    g.kind[g.n] = repack ? kGDense + int(p.quant) : int(p.quant);
    g.off[g.n] = off;
    rows += int(p.rows);
    off += (size_t(p.rows) * gguf_row_bytes(g.kind[g.n], cols) + 15) / 16 * 16;
    ++g.n;
  }
  g.row0[g.n] = rows;
  bytes = off;
  return g;
}

}  // namespace flashmoe::cuda
