// cpu::matmul over several tokens: every token's outputs have the bits of
// that token's product alone (what lets a batched step give each sequence
// its answer alone), for every token count around the paths' edges (up to
// simd::stored_row_tokens from the stored rows: 3, or 16 at avx512; more
// through the widened panel), and are within float rounding of
// double-precision sums computed here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/matmul.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/matrix.h"
#include "core/thread_pool.h"

namespace matmul_test {

using namespace flashmoe;

TEST(CpuMatmul, EachTokenGetsTheBitsOfItsProductAlone) {
  const int64_t R = 37, K = 200;  // a tail of rows past the blocks of 4 and 16, a masked tail of columns
  std::mt19937 g(5);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> wf(size_t(R * K));
  for (auto& v : wf) v = d(g);
  std::vector<uint16_t> wb(wf.size()), wh(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    wb[i] = f32_to_bf16(wf[i]);
    wh[i] = f32_to_f16(wf[i]);
  }
  ThreadPool serial(1), two(2);
  for (DType t : {DType::BF16, DType::F16, DType::F32}) {
    Matrix W;
    W.dtype = t;
    W.rows = R;
    W.cols = K;
    W.data = t == DType::BF16 ? static_cast<const void*>(wb.data())
             : t == DType::F16 ? static_cast<const void*>(wh.data())
                               : static_cast<const void*>(wf.data());
    auto weight = [&](int64_t r, int64_t k) {
      const size_t i = size_t(r * K + k);
      return t == DType::BF16 ? bf16_to_f32(wb[i]) : t == DType::F16 ? f16_to_f32(wh[i]) : wf[i];
    };
    for (int64_t n = 1; n <= 18; ++n)
      for (ThreadPool* pool : {&serial, &two}) {
        std::vector<float> x(size_t(n * K)), y(size_t(n * R));
        for (auto& v : x) v = d(g);
        cpu::matmul(*pool, W, x.data(), n, y.data());
        for (int64_t j = 0; j < n; ++j) {
          std::vector<float> alone(static_cast<size_t>(R));
          cpu::matmul(*pool, W, x.data() + j * K, 1, alone.data());
          for (int64_t r = 0; r < R; ++r) {
            const float got = y[size_t(j * R + r)];
            ASSERT_EQ(std::memcmp(&got, &alone[size_t(r)], 4), 0)
                << "dtype " << int(t) << ", " << n << " tokens, token " << j << ", row " << r;
            double want = 0;
            for (int64_t k = 0; k < K; ++k) want += double(weight(r, k)) * double(x[size_t(j * K + k)]);
            EXPECT_NEAR(got, want, 1e-4) << "dtype " << int(t) << ", " << n << " tokens, token " << j << ", row " << r;
          }
        }
      }
  }
}

// cpu::matmuls (a group of products of one input in one parallel region):
// every product's outputs have the bits of its own matmul, for groups whose
// rows are split across products by the threads' claims (three products of
// 37, 5 and 300 rows: claims of whole tiles then span two products), at 1-9
// tokens, and a product past the group's width is refused.
TEST(CpuMatmul, AGroupOfProductsGivesEachTheBitsOfItsOwn) {
  const int64_t K = 72;
  const int64_t rows[] = {37, 5, 300};
  std::mt19937 g(11);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<std::vector<uint16_t>> wb(3);
  std::vector<Matrix> W(3);
  for (int i = 0; i < 3; ++i) {
    wb[size_t(i)].resize(size_t(rows[i] * K));
    for (auto& v : wb[size_t(i)]) v = f32_to_bf16(d(g));
    W[size_t(i)].dtype = DType::BF16;
    W[size_t(i)].rows = rows[i];
    W[size_t(i)].cols = K;
    W[size_t(i)].data = wb[size_t(i)].data();
  }
  ThreadPool serial(1), two(2), three(3);
  for (int64_t n = 1; n <= 9; ++n)
    for (ThreadPool* pool : {&serial, &two, &three}) {
      std::vector<float> x(size_t(n * K));
      for (auto& v : x) v = d(g);
      std::vector<std::vector<float>> y(3), want(3);
      std::vector<cpu::Product> products;
      for (int i = 0; i < 3; ++i) {
        y[size_t(i)].assign(size_t(n * rows[i]), -1.0f);
        want[size_t(i)].resize(size_t(n * rows[i]));
        cpu::matmul(*pool, W[size_t(i)], x.data(), n, want[size_t(i)].data());
        products.push_back({&W[size_t(i)], y[size_t(i)].data()});
      }
      cpu::matmuls(*pool, products.data(), products.size(), x.data(), n);
      for (int i = 0; i < 3; ++i)
        ASSERT_EQ(std::memcmp(y[size_t(i)].data(), want[size_t(i)].data(), y[size_t(i)].size() * 4), 0)
            << n << " tokens, " << pool->size() << " threads, product " << i;
    }
  Matrix wide = W[0];
  wide.cols = K + 1;
  std::vector<float> x(size_t(K + 1)), y(1000);
  const cpu::Product mixed[] = {{&W[0], y.data()}, {&wide, y.data()}};
  EXPECT_THROW(cpu::matmuls(serial, mixed, 2, x.data(), 1), Error);
}

}  // namespace matmul_test
