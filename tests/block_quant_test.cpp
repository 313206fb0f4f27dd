// The GGUF block formats: random blocks dequantised by a separate, per-weight
// reading of each layout (ggml-common.h) against the kernels' row reads and
// products, at every CPU level this machine has.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "backend/cuda/gguf_blocks.cuh"
#include "core/block_quant.h"
#include "core/dtype.h"
#include "core/matrix_rows.h"

namespace block_quant_test {

using namespace flashmoe;

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

// Random blocks whose f16 scales are finite and moderate.
std::vector<uint8_t> random_rows(QuantKind q, int64_t rows, int64_t cols, std::mt19937& rng) {
  const int64_t be = block_elems(q), bb = block_bytes(q), nb = rows * cols / be;
  std::vector<uint8_t> d(size_t(nb * bb));
  for (auto& x : d) x = uint8_t(rng());
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (int64_t k = 0; k < nb; ++k) {
    uint8_t* b = d.data() + k * bb;
    auto put = [&](size_t at) {
      const uint16_t v = f32_to_f16(u(rng));
      std::memcpy(b + at, &v, 2);
    };
    switch (q) {
      case QuantKind::Q4_1: case QuantKind::Q5_1: case QuantKind::Q4_K: case QuantKind::Q5_K:
        put(0);
        put(2);
        break;
      case QuantKind::Q6_K: put(208); break;
      default: put(0); break;
    }
  }
  return d;
}

class BlockQuant : public ::testing::TestWithParam<QuantKind> {};

TEST_P(BlockQuant, RowsAndProductsMatchTheLayout) {
  const QuantKind q = GetParam();
  std::mt19937 rng(1234 + int(q));
  const int64_t rows = 5, cols = 3 * 256;  // several blocks per row of every kind
  std::vector<uint8_t> data = random_rows(q, rows, cols, rng);
  Matrix W;
  W.dtype = DType::U8;
  W.quant = q;
  W.data = data.data();
  W.rows = rows;
  W.cols = cols;
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
  std::vector<uint8_t> data = random_rows(q, rows, cols, rng);
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

INSTANTIATE_TEST_SUITE_P(Kinds, BlockQuant,
                         ::testing::Values(QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q5_0,
                                           QuantKind::Q5_1, QuantKind::IQ4_NL, QuantKind::Q4_K, QuantKind::Q5_K,
                                           QuantKind::Q6_K, QuantKind::IQ4_XS),
                         [](const auto& info) { return std::string(quant_name(info.param)); });

}  // namespace

}  // namespace block_quant_test
