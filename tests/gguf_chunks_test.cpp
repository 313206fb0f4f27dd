// The chunk layout of GGUF Q4_K / Q6_K blocks (backend/cuda/gguf_chunks.cuh),
// on the host, no GPU: rearranged blocks give every weight exactly as the
// file's blocks do (gguf_weights8, whose stored-layout cases the BlockQuant
// tests check against ggml's layouts), and the expert kernels' chunk dot
// (gchunk_load + gchunk_dot over x staged chunk-major) sums to the row's dot.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/gguf_chunks.cuh"
#include "core/block_quant.h"
#include "core/dtype.h"

namespace gguf_chunks_test {

using namespace flashmoe;

namespace {

// Random blocks of kind q (Q4_K or Q6_K) with finite, moderate f16 scales.
std::vector<uint8_t> random_blocks(QuantKind q, int64_t nb, std::mt19937& rng) {
  const int64_t bb = block_bytes(q);
  std::vector<uint8_t> d(size_t(nb * bb));
  for (auto& x : d) x = uint8_t(rng());
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (int64_t k = 0; k < nb; ++k)
    for (size_t at : q == QuantKind::Q4_K ? std::vector<size_t>{0, 2} : std::vector<size_t>{208}) {
      const uint16_t v = f32_to_f16(u(rng));
      std::memcpy(d.data() + k * bb + at, &v, 2);
    }
  return d;
}

// Rows of blocks of kind q rearranged into the chunk layout.
std::vector<uint8_t> to_chunks(QuantKind q, const std::vector<uint8_t>& blocks) {
  const int k = int(q), c = cuda::gguf_c32_kind(k);
  const size_t nb = blocks.size() / size_t(cuda::gguf_block_bytes(k));
  std::vector<uint8_t> out(nb * size_t(cuda::gguf_block_bytes(c)));
  for (size_t b = 0; b < nb; ++b)
    cuda::gguf_c32_block(k, blocks.data() + b * size_t(cuda::gguf_block_bytes(k)),
                         out.data() + b * size_t(cuda::gguf_block_bytes(c)));
  return out;
}

class GgufChunks : public ::testing::TestWithParam<QuantKind> {};

TEST_P(GgufChunks, LayoutKeepsEveryWeight) {
  const QuantKind q = GetParam();
  std::mt19937 rng(31 + int(q));
  const int cols = 4 * 256, rows = 5;
  const std::vector<uint8_t> stored = random_blocks(q, rows * cols / 256, rng), chunks = to_chunks(q, stored);
  const int k = int(q), c = cuda::gguf_c32_kind(k);
  ASSERT_EQ(cuda::gguf_row_bytes(c, cols), size_t(cols / 256) * (q == QuantKind::Q4_K ? 192 : 256));
  ASSERT_EQ(chunks.size(), size_t(rows) * cuda::gguf_row_bytes(c, cols));
  for (int r = 0; r < rows; ++r)
    for (int col = 0; col < cols; col += 8) {
      float want[8], got[8];
      cuda::gguf_weights8(k, stored.data() + size_t(r) * cuda::gguf_row_bytes(k, cols), col, want);
      cuda::gguf_weights8(c, chunks.data() + size_t(r) * cuda::gguf_row_bytes(c, cols), col, got);
      for (int i = 0; i < 8; ++i)
        ASSERT_EQ(std::memcmp(&want[i], &got[i], 4), 0)
            << quant_name(q) << " row " << r << " col " << col + i << ": " << want[i] << " vs " << got[i];
    }
}

TEST_P(GgufChunks, ChunkDotMatchesTheRow) {
  const QuantKind q = GetParam();
  std::mt19937 rng(57 + int(q));
  const int cols = 8 * 256, cpr = cols / 32, rows = 3;
  const std::vector<uint8_t> stored = random_blocks(q, rows * cols / 256, rng), chunks = to_chunks(q, stored);
  const int k = int(q), c = cuda::gguf_c32_kind(k);
  std::vector<float> x(static_cast<size_t>(cols));
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& v : x) v = n(rng);
  // x chunk-major as stage_chunks<4> writes it (quant_experts.cuh): float4 i
  // of chunk ch at float4 index i * cpr + ch; the sums of its 8-column pieces p at s8[p * cpr + ch].
  std::vector<float> xq(static_cast<size_t>(cols)), s8(static_cast<size_t>(cols / 8));
  for (int ch = 0; ch < cpr; ++ch)
    for (int i = 0; i < 8; ++i)
      for (int e = 0; e < 4; ++e) xq[size_t(4 * (i * cpr + ch) + e)] = x[size_t(32 * ch + 4 * i + e)];
  for (int ch = 0; ch < cpr; ++ch)
    for (int p = 0; p < 4; ++p) {
      float t = 0.f;
      for (int e = 0; e < 8; ++e) t += x[size_t(32 * ch + 8 * p + e)];
      s8[size_t(p * cpr + ch)] = t;
    }
  for (int r = 0; r < rows; ++r) {
    double dot = 0, mag = 0;
    for (int col = 0; col < cols; col += 8) {
      float w[8];
      cuda::gguf_weights8(k, stored.data() + size_t(r) * cuda::gguf_row_bytes(k, cols), col, w);
      for (int i = 0; i < 8; ++i) dot += double(w[i]) * x[size_t(col + i)], mag += std::fabs(double(w[i]) * x[size_t(col + i)]);
    }
    float got = 0.f;
    const uint8_t* row = chunks.data() + size_t(r) * cuda::gguf_row_bytes(c, cols);
    for (int ch = 0; ch < cpr; ++ch) {
      cuda::GChunk g;
      cuda::gchunk_load(c, row, ch, g);
      got += cuda::gchunk_dot(c, g, xq.data() + 4 * ch, s8.data() + ch, cpr);
    }
    EXPECT_NEAR(got, dot, 1e-5 * mag) << quant_name(q) << " row " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, GgufChunks, ::testing::Values(QuantKind::Q4_K, QuantKind::Q6_K),
                         [](const auto& info) { return std::string(quant_name(info.param)); });

TEST(GgufChunks, OnlyQ4KAndQ6KHaveTheLayout) {
  for (QuantKind q : {QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q5_K, QuantKind::IQ4_XS})
    EXPECT_EQ(cuda::gguf_c32_kind(int(q)), -1) << quant_name(q);
  EXPECT_EQ(cuda::gguf_c32_kind(int(QuantKind::Q4_K)), cuda::GQ_Q4_K_C32);
  EXPECT_EQ(cuda::gguf_c32_kind(int(QuantKind::Q6_K)), cuda::GQ_Q6_K_C32);
}

}  // namespace

}  // namespace gguf_chunks_test
