// The GGUF block formats: random blocks dequantised by a separate, per-weight
// reading of each layout (ggml-common.h) against the kernels' row reads and
// products, at every CPU level this machine has.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "backend/cpu/matmul.h"
#include "backend/cuda/gguf_blocks.cuh"
#include "backend/cuda/gguf_dense_repack.cuh"
#include "backend/cuda/gguf_warp_dot.cuh"
#include "core/block_quant.h"
#include "core/block_quant_i16.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/matrix_rows.h"
#include "test_util.h"

namespace block_quant_test {

using namespace flashmoe;
using flashmoe::test::quant_matrix;
using flashmoe::test::random_quant_blocks;

namespace {

const int8_t kT[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

float h(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return f16_to_f32(v);
}
int nib(const uint8_t* qs, int i) {  // weight i of a 32-weight nibble run: byte i%16, high half for i >= 16
  return (qs[i % 16] >> (4 * (i / 16))) & 15;
}
void k_scale(const uint8_t* s, int j, int* sc, int* m) {  // 6-bit (scale, min) j of 8 in 12 bytes
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Weight i of one block, read straight from the documented layout.
float ref_weight(QuantKind q, const uint8_t* b, int i) {
  switch (q) {
    case QuantKind::Q8_0: return h(b) * float(int8_t(b[2 + i]));
    case QuantKind::Q4_0: return h(b) * float(nib(b + 2, i) - 8);
    case QuantKind::Q4_1: return h(b) * float(nib(b + 4, i)) + h(b + 2);
    case QuantKind::IQ4_NL: return h(b) * float(kT[nib(b + 2, i)]);
    case QuantKind::Q5_0: case QuantKind::Q5_1: {
      const bool m = q == QuantKind::Q5_1;
      uint32_t qh;
      std::memcpy(&qh, b + (m ? 4 : 2), 4);
      const int v = nib(b + (m ? 8 : 6), i) | int((qh >> i) & 1) << 4;
      return m ? h(b) * float(v) + h(b + 2) : h(b) * float(v - 16);
    }
    case QuantKind::Q4_K: case QuantKind::Q5_K: {
      const bool five = q == QuantKind::Q5_K;
      const int j = i / 32, l = i % 32;
      int sc, mn;
      k_scale(b + 4, j, &sc, &mn);
      const uint8_t* qs = b + (five ? 48 : 16);
      int v = (qs[(i / 64) * 32 + l] >> (4 * (j % 2))) & 15;
      if (five) v += ((b[16 + l] >> j) & 1) << 4;
      return h(b) * float(sc) * float(v) - h(b + 2) * float(mn);
    }
    case QuantKind::Q6_K: {
      const int n = i / 128, r = i % 128, part = r / 32, l = r % 32;
      const uint8_t lo = b[n * 64 + l + (part % 2) * 32];
      const int low = (lo >> (4 * (part / 2))) & 15;
      const int high = (b[128 + n * 32 + l] >> (2 * part)) & 3;
      const int8_t sc = int8_t(b[192 + n * 8 + l / 16 + 2 * part]);
      return h(b + 208) * float(sc) * float((low | high << 4) - 32);
    }
    case QuantKind::IQ4_XS: {
      const int ib = i / 32, j = i % 32;
      uint16_t sh;
      std::memcpy(&sh, b + 2, 2);
      const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
      return h(b) * float(ls - 32) * float(kT[nib(b + 8 + ib * 16, j)]);
    }
    default: return NAN;
  }
}

class BlockQuant : public ::testing::TestWithParam<QuantKind> {};

TEST_P(BlockQuant, RowsAndProductsMatchTheLayout) {
  const QuantKind q = GetParam();
  std::mt19937 rng(1234 + int(q));
  const int64_t rows = 5, cols = 3 * 256;  // several blocks per row of every kind
  const std::vector<uint8_t> data = random_quant_blocks(q, rows, cols, rng);
  const Matrix W = quant_matrix(q, data, rows, cols);
  ASSERT_EQ(W.nbytes(), data.size());
  std::vector<float> x(static_cast<size_t>(cols));
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& v : x) v = n(rng);
  const int64_t be = block_elems(q);
  std::vector<float> got(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    cpu::block_dequant_row(W, r, got.data());
    double dot = 0, mag = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t* blk = data.data() + size_t(r) * W.row_bytes() + size_t(c / be) * size_t(block_bytes(q));
      const float want = ref_weight(q, blk, int(c % be));
      ASSERT_NEAR(got[c], want, 1e-6f * (1.0f + std::fabs(want))) << quant_name(q) << " row " << r << " col " << c;
      dot += double(want) * x[c];
      mag += std::fabs(double(want) * x[c]);
    }
    for (CpuLevel level : {CpuLevel::Portable, CpuLevel::Avx2, CpuLevel::Avx512}) {
      if (level > cpu_level_supported()) continue;
      const float d = cpu::block_dot_row_at(level, W, r, x.data());
      EXPECT_NEAR(d, dot, 1e-5 * mag) << quant_name(q) << " level " << cpu_level_name(level);
      // Through the generic entry points the CPU backend uses.
      EXPECT_NEAR(cpu::quant_dot_row_at(level, W, r, x.data()), dot, 1e-5 * mag);
    }
  }
}

// The CUDA kernels' block reader (backend/cuda/gguf_blocks.cuh, compiled
// here for the host): every 8-weight piece of every row equals the layout.
TEST_P(BlockQuant, DeviceReaderMatchesTheLayout) {
  const QuantKind q = GetParam();
  std::mt19937 rng(4321 + int(q));
  const int64_t rows = 3, cols = 2 * 256;
  std::vector<uint8_t> data = random_quant_blocks(q, rows, cols, rng);
  const int64_t be = block_elems(q), rb = rows ? int64_t(data.size()) / rows : 0;
  ASSERT_EQ(size_t(rb), cuda::gguf_row_bytes(int(q), int(cols)));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 8) {
      float w[8];
      cuda::gguf_weights8(int(q), data.data() + r * rb, int(c), w);
      for (int i = 0; i < 8; ++i) {
        const uint8_t* blk = data.data() + r * rb + ((c + i) / be) * block_bytes(q);
        const float want = ref_weight(q, blk, int((c + i) % be));
        ASSERT_NEAR(w[i], want, 1e-6f * (1.0f + std::fabs(want))) << quant_name(q) << " row " << r << " col " << c + i;
      }
    }
}

// The int16-activation products (core/block_quant_i16.h): per group of 256
// columns (rows of whole 256-blocks), high codes lrint(x * 32767 / max|x|)
// and low codes of the rest in steps of 1/65536; a row's dot equals the
// same formula in double over those codes (the kernel's own arithmetic:
// the integer sums are exact), and the exact fp32 dot within the bound the
// rounding allows. Every block of 32's largest value is 300, its others sit
// 0.45 of a high-code step off a code, on the side of row 0's weight: row
// 0's dot from the high codes alone is off by far more than that bound (the
// low codes are needed to pass). The second group is all zero (scale 0).
TEST_P(BlockQuant, Int16ActivationProducts) {
  const QuantKind q = GetParam();
  const bool kind_has_i16 = q == QuantKind::Q4_K || q == QuantKind::Q6_K || q == QuantKind::Q8_0 || q == QuantKind::Q5_0;
  std::mt19937 rng(777 + int(q));
  const int64_t rows = 5, cols = 3 * 256, be = block_elems(q), bb = block_bytes(q);
  const std::vector<uint8_t> data = random_quant_blocks(q, rows, cols, rng);
  const Matrix W = quant_matrix(q, data, rows, cols);
  // Weight (r, c) and, for Q4_K, the min term dmin * m of its sub-block.
  auto weight = [&](int64_t r, int64_t c, double* minterm) {
    const uint8_t* blk = data.data() + size_t(r) * W.row_bytes() + size_t(c / be) * size_t(bb);
    *minterm = 0;
    if (q == QuantKind::Q4_K) {
      int sc, mn;
      k_scale(blk + 4, int(c % be) / 32, &sc, &mn);
      *minterm = double(h(blk + 2)) * mn;
    }
    return double(ref_weight(q, blk, int(c % be)));
  };
  const float step = 300.0f / 32767.0f;
  std::vector<float> x(static_cast<size_t>(cols));
  std::uniform_int_distribution<int> code(-300, 300);
  for (int64_t c = 0; c < cols; ++c) {
    double mt;
    const double w = weight(0, c, &mt);
    x[size_t(c)] = c % 32 == (c / 32) % 32 ? 300.0f * ((c / 32) % 2 ? -1.0f : 1.0f)
                                           : (float(code(rng)) + (w + mt >= 0 ? 0.45f : -0.45f)) * step;
  }
  std::fill(x.begin() + 256, x.begin() + 512, 0.0f);  // an all-zero group: scale 0
  cpu::Int16Activations xq;
  cpu::quantize_activations_i16(x.data(), cols, xq);
  for (int64_t c = 0; c < cols; ++c) {
    const float amax = c / 256 == 1 ? 0.0f : 300.0f;
    const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
    const float hi = float(std::lrint(x[size_t(c)] * inv));
    ASSERT_EQ(cpu::i16_code_at(xq, c), hi) << "col " << c;
    const long lo = std::clamp(std::lrint(std::fma(x[size_t(c)], inv, -hi) * 65536.0f), -32767L, 32767L);
    ASSERT_EQ(cpu::i16_code_at(xq, c, true), lo) << "col " << c;
  }
  EXPECT_FLOAT_EQ(xq.scale[0], step);
  EXPECT_EQ(xq.scale[8], 0.0f);
  EXPECT_EQ(xq.scale[15], 0.0f);
  double s0 = 0;
  for (int i = 0; i < 32; ++i) s0 += x[size_t(i)];
  EXPECT_NEAR(xq.sum[0], s0, 1e-3);

  std::vector<double> exact_of(static_cast<size_t>(rows)), mag_of(static_cast<size_t>(rows));
  for (CpuLevel level : {CpuLevel::Portable, CpuLevel::Avx2, CpuLevel::Avx512, CpuLevel::Avx512Vnni}) {
    if (level > cpu_level_supported()) continue;
    SCOPED_TRACE(std::string(quant_name(q)) + " level " + cpu_level_name(level));
    const bool supported = kind_has_i16 && level >= CpuLevel::Avx2;
    ASSERT_EQ(cpu::block_dot_i16_supported(level, q), supported);
    if (!supported) {
      EXPECT_THROW(cpu::block_dot_row_i16_at(level, W, 0, xq), Error);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      double same_codes = 0, high_only = 0, exact = 0, bound = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        double mt;  // Q4_K's min term meets the exact sum of x
        const double w = weight(r, c, &mt), a = xq.scale[size_t(c / 32)];
        const double hi = cpu::i16_code_at(xq, c), lo = cpu::i16_code_at(xq, c, true);
        same_codes += (w + mt) * a * (hi + lo / 65536.0) - mt * x[size_t(c)];
        high_only += (w + mt) * a * hi - mt * x[size_t(c)];
        exact += w * x[size_t(c)];
        bound += std::fabs(w + mt) * a / 131072.0;
        mag += std::fabs(w * x[size_t(c)]) + std::fabs(mt * x[size_t(c)]);
      }
      exact_of[size_t(r)] = exact;
      mag_of[size_t(r)] = mag;
      const float got = cpu::block_dot_row_i16_at(level, W, r, xq);
      // Every level's integer sums are exact: the same bits as AVX2's where
      // the same fp32 steps follow (not the 512-bit kernels of avx512vnni,
      // whose int32 lanes and fp32 sums are laid out differently).
      if (level != CpuLevel::Avx512Vnni) {
        EXPECT_EQ(got, cpu::block_dot_row_i16_at(CpuLevel::Avx2, W, r, xq)) << "row " << r;
      }
      EXPECT_NEAR(got, same_codes, 2e-6 * mag) << "row " << r;
      EXPECT_NEAR(got, exact, bound + 2e-6 * mag) << "row " << r;
      if (r == 0) {
        EXPECT_GT(std::fabs(high_only - exact), 100 * (bound + 2e-6 * mag));
      }
    }
  }
  // The CPU backend's one-token product takes this path at the CPU's level;
  // two tokens stay in fp32.
  if (cpu::block_dot_i16_supported(cpu_level(), q)) {
    std::vector<float> y(static_cast<size_t>(rows)), y2(static_cast<size_t>(2 * rows)), x2(x);
    x2.insert(x2.end(), x.begin(), x.end());
    cpu::matmul_serial(W, x.data(), 1, cols, y.data(), rows);
    cpu::matmul_serial(W, x2.data(), 2, cols, y2.data(), rows);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(y[size_t(r)], cpu::block_dot_row_i16_at(cpu_level(), W, r, xq)) << "row " << r;
      EXPECT_NEAR(y2[size_t(r)], exact_of[size_t(r)], 2e-6 * mag_of[size_t(r)]) << "row " << r;
      EXPECT_EQ(y2[size_t(rows + r)], y2[size_t(r)]) << "row " << r;
    }
  }
  // The portable rounding gives the same codes and scales.
  cpu::Int16Activations xp;
  cpu::quantize_activations_i16_at(CpuLevel::Portable, x.data(), cols, xp);
  EXPECT_EQ(xp.code, xq.code);
  EXPECT_EQ(xp.scale, xq.scale);
  for (size_t b = 0; b < xp.sum.size(); ++b) EXPECT_NEAR(xp.sum[b], xq.sum[b], 1e-3) << "block " << b;
  std::vector<float> odd(48);
  EXPECT_THROW(cpu::quantize_activations_i16(odd.data(), 48, xq), Error);
  // Rows that are not whole 256-blocks (Q8_0 / Q5_0 tensors of 96 or 128
  // columns): one scale per block of 32.
  std::vector<float> x96(x.begin(), x.begin() + 96);
  x96[5] = 600.0f;
  cpu::quantize_activations_i16(x96.data(), 96, xq);
  EXPECT_FLOAT_EQ(xq.scale[0], 600.0f / 32767.0f);
  EXPECT_FLOAT_EQ(xq.scale[1], step);
  EXPECT_FLOAT_EQ(xq.scale[2], step);
}

// The CUDA decode kernels' warp dot (backend/cuda/gguf_warp_dot.cuh: a
// block per warp iteration for Q4_K / Q6_K, 8 columns a lane otherwise),
// its 32 lanes run here on the host: their shares sum to the row's dot with
// the layout's weights, for aligned rows and for a row shifted off the
// alignment the block loads need (the 8-column fallback).
TEST_P(BlockQuant, DeviceWarpDotMatchesTheLayout) {
  const QuantKind q = GetParam();
  std::mt19937 rng(777 + int(q));
  // 3 blocks a row (Q4_K: the whole warp a block) and 8 (Q4_K: a quarter-warp a block).
  for (const int64_t cols : {int64_t(3 * 256), int64_t(8 * 256)}) {
    const int64_t rows = 3;
    const std::vector<uint8_t> data = random_quant_blocks(q, rows, cols, rng);
    const int64_t be = block_elems(q), rb = int64_t(data.size()) / rows;
    std::vector<float> x(static_cast<size_t>(cols));
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (float& v : x) v = n(rng);
    std::vector<uint8_t> shifted(data.size() + 1);  // row 0 at an odd address
    std::memcpy(shifted.data() + 1, data.data(), data.size());
    for (int64_t r = 0; r < rows; ++r) {
      double dot = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const float w = ref_weight(q, data.data() + r * rb + (c / be) * block_bytes(q), int(c % be));
        dot += double(w) * x[c];
        mag += std::fabs(double(w) * x[c]);
      }
      for (const uint8_t* row : std::initializer_list<const uint8_t*>{data.data() + r * rb, shifted.data() + 1 + r * rb}) {
        float got = 0.f;
        for (int lane = 0; lane < 32; ++lane) got += cuda::gguf_lane_row_dot(int(q), row, x.data(), int(cols), lane);
        EXPECT_NEAR(got, dot, 1e-5 * mag) << quant_name(q) << " row " << r
                                          << (row == data.data() + r * rb ? " aligned" : " shifted");
      }
    }
    // The block-per-warp path is taken where it exists and the row allows it.
    EXPECT_EQ(cuda::gguf_block_per_warp(int(q), data.data()), q == QuantKind::Q4_K || q == QuantKind::Q6_K);
    EXPECT_FALSE(cuda::gguf_block_per_warp(int(q), shifted.data() + 1));
  }
}

// Dense matrices repacked at upload for the CUDA decode matvec
// (backend/cuda/gguf_dense_layout.cuh): every 8 columns read from the
// repacked row (what the prefill's product and the embedding read) are bit
// for bit the file's weights, and the 32 lanes' group dots (the matvec
// kernel's arithmetic, run here on the host) sum to the row's dot. The IQ4
// kinds (a table, not a linear code) and rows not of whole 256-column
// blocks keep the file's blocks.
TEST_P(BlockQuant, DenseRepackMatchesTheLayout) {
  const QuantKind q = GetParam();
  const bool kind = q != QuantKind::IQ4_NL && q != QuantKind::IQ4_XS;
  EXPECT_EQ(cuda::gdense_repackable(int(q), 512), kind) << quant_name(q);
  EXPECT_FALSE(cuda::gdense_repackable(int(q), 288)) << quant_name(q);
  if (!kind) return;
  std::mt19937 rng(4242 + int(q));
  const int rows = 3, cols = 3 * 256;
  const std::vector<uint8_t> data = random_quant_blocks(q, rows, cols, rng);
  const int rk = cuda::kGDense + int(q);
  const size_t rb = cuda::gguf_row_bytes(rk, cols), fb = data.size() / rows;
  std::vector<uint8_t> packed(rows * rb);
  cuda::gdense_repack_rows(int(q), data.data(), rows, cols, packed.data());
  std::vector<float> x(static_cast<size_t>(cols));
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& v : x) v = n(rng);
  const cuda::GDenseKind in = cuda::gdense_info(rk);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = packed.data() + r * rb;
    for (int c = 0; c < cols; c += 8) {
      float want[8], got[8];
      cuda::gguf_weights8(int(q), data.data() + r * fb, c, want);
      cuda::gguf_weights8(rk, row, c, got);
      for (int i = 0; i < 8; ++i) ASSERT_EQ(got[i], want[i]) << quant_name(q) << " row " << r << " column " << c + i;
    }
    double dot = 0, mag = 0;
    for (int c = 0; c < cols; ++c) {
      const float w = ref_weight(q, data.data() + r * fb + (c / block_elems(q)) * block_bytes(q), int(c % block_elems(q)));
      dot += double(w) * x[size_t(c)];
      mag += std::fabs(double(w) * x[size_t(c)]);
    }
    float got = 0.f;
    for (int g = 0; g < cols / 32; ++g) {  // group g: lane g % 32 of tile g / 32
      const float* xg = x.data() + 32 * g;
      float sx = 0.f;
      for (int i = 0; i < 32; ++i) sx += xg[i];
      cuda::gdense_with_kind(in, [&](auto h, auto mn) {
        cuda::GDenseRows<decltype(h)::value, 1> d;
        cuda::gdense_load_group(row + (g / 8) * cuda::gdense_block_bytes(rk), g % 8, in.h, d.lo[0], d.hi[0], d.p0[0],
                                d.p1[0]);
        float acc[1] = {0.f};
        cuda::gdense_rows_dot<decltype(h)::value, decltype(mn)::value, 1>(d, xg, 0, sx, float(in.off), acc);
        got += acc[0];
      });
    }
    EXPECT_NEAR(got, dot, 1e-5 * mag) << quant_name(q) << " row " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, BlockQuant,
                         ::testing::Values(QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q5_0,
                                           QuantKind::Q5_1, QuantKind::IQ4_NL, QuantKind::Q4_K, QuantKind::Q5_K,
                                           QuantKind::Q6_K, QuantKind::IQ4_XS),
                         [](const auto& info) { return std::string(quant_name(info.param)); });

}  // namespace

}  // namespace block_quant_test
