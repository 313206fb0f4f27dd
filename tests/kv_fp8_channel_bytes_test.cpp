// fp8 `channel`'s bytes, counted by hand for coder-mini and held against
// kv-calc and against what a cache really allocates; its storage round trip
// (f24 / bf16 scales that lose nothing, values within half a code step). The KL
// guard on coder-mini is in eval_test.cpp (Eval.Fp8ChannelKlGuard).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "format/config.h"
#include "kv/fp8_e4m3.h"
#include "kv/kv_cache.h"
#include "kv/kv_kernels.h"
#include "kv/memory_calc.h"
#include "test_util.h"

namespace kv_fp8_channel_bytes_test {

using namespace flashmoe;

namespace {

using Vec = std::vector<float>;

KvConfig channel() {
  KvConfig c;
  c.dtype = KvDType::FP8;
  c.fp8_scale = Fp8ScaleMode::Channel;
  c.fp8_scale_set = true;
  return c;
}

Vec gauss(std::mt19937& rng, int64_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  Vec v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

// coder-mini: 2 full-attention layers x 2 KV heads x head_dim 64. By hand,
// at 2,048 positions:
//   codes           2,048 x 2 layers x 2 (K,V) x 2 heads x 64 x 1 B = 1,048,576
//   scales          2,048 x 2 layers x 2 heads x (3 B K f24 + 2 B V bf16) = 40,960
//   key offsets     8 pages x 2 layers x 2 heads x 64 x 4 B          =     8,192
//   query moments   2 layers x 2 heads x (64 x 65 / 2) x 4 B         =    33,280
//   page key sums   2 layers x 2 heads x 64 x 4 B                    =     1,024
//   total                                                             = 1,132,032
// against f32's 2,048 x 2 x 2 x 2 x 64 x 4 = 4,194,304: 26.99% (<= 27%).
TEST(KvFp8ChannelBytes, CoderMiniByHand) {
  const ModelConfig m = load_model_config(test::source_path("models/coder-mini/model"));
  ASSERT_EQ(m.num_full_layers(), 2);
  ASSERT_EQ(m.num_kv_heads, 2);
  ASSERT_EQ(m.head_dim, 64);
  const KvMemory mem = kv_memory(m, channel());
  EXPECT_EQ(mem.data_bytes_per_position, 512);
  EXPECT_EQ(mem.scale_bytes_per_position, 20);
  EXPECT_EQ(mem.offset_bytes_per_page, 1024);
  EXPECT_EQ(mem.query_moment_bytes, 33280);
  EXPECT_EQ(mem.page_sum_bytes, 1024);
  EXPECT_EQ(kv_cache_bytes(m, channel(), 2048), 1132032);
  EXPECT_EQ(kv_cache_bytes(m, KvConfig{}, 2048), 4194304);
  EXPECT_LE(1132032.0 / 4194304.0, 0.27);
  // A sequence of one position already holds the per-sequence bytes and one
  // page of offsets; none before its first position.
  EXPECT_EQ(kv_cache_bytes(m, channel(), 1), 532 + 1024 + 33280 + 1024);
  EXPECT_EQ(kv_cache_bytes(m, channel(), 0), 0);
  // kv-calc says what it counts.
  const std::string r = kv_calc_report(m, "coder-mini", channel(), {2048});
  EXPECT_NE(r.find("KV per position: 532 B (532 B) = 512 B K/V data (512 B) + 20 B fp8 scales"), std::string::npos) << r;
  EXPECT_NE(r.find("KV per sequence (in the KV cache column, whatever the context): 34304 B = 33280 B query second "
                   "moments"),
            std::string::npos)
      << r;
  EXPECT_NE(r.find("26.99%"), std::string::npos) << r;
}

// What one layer's cache really allocates, once the queries' factors are
// dropped (as the model does after each chunk), is kv-calc's count for one
// layer plus the 8 B per slot of position bookkeeping.
TEST(KvFp8ChannelBytes, CacheAllocatesWhatKvCalcCounts) {
  const ModelConfig m = load_model_config(test::source_path("models/coder-mini/model"));
  const int64_t nkv = m.num_kv_heads, hd = m.head_dim, nh = m.num_heads, row = nkv * hd, n = 2048;
  std::mt19937 rng(3);
  KvCache c(nkv, hd, channel());
  for (int64_t p = 0; p < n; p += 256) {  // chunks of 256, as a prompt goes
    const Vec q = gauss(rng, 256 * nh * hd);
    c.add_query_moments(q.data(), 256, nh);
    for (int64_t t = p; t < p + 256; ++t) {
      const Vec k = gauss(rng, row), v = gauss(rng, row);
      c.append(t, k.data(), v.data());
    }
    c.drop_query_factors();
  }
  const int64_t layers = m.num_full_layers();
  EXPECT_EQ(int64_t(c.bytes()) * layers, kv_cache_bytes(m, channel(), n) + layers * n * 8);
}

// The storage round trip: every value decodes (in the rotated basis, where
// it is stored) to within half an E4M3 step of itself at its stored scale
// (a scale stored in a narrower type than it was chosen in would fail
// this by shifting every code), and the candidates are bf16 / f24 values.
TEST(KvFp8ChannelBytes, RoundTrip) {
  const int64_t nkv = 2, hd = 64, row = nkv * hd, n = 300;
  std::mt19937 rng(9);
  KvCache c(nkv, hd, channel());
  std::vector<Vec> vs;
  for (int64_t p = 0; p < n; ++p) {
    const Vec k = gauss(rng, row, 4.0f), v = gauss(rng, row);
    c.append(p, k.data(), v.data());
    vs.push_back(v);
  }
  Vec k(static_cast<size_t>(row)), v(static_cast<size_t>(row));
  for (int64_t s = 0; s < n; ++s) {
    c.dequantize(s, k.data(), v.data());
    for (int64_t h = 0; h < nkv; ++h) {
      Vec a(vs[size_t(s)].begin() + h * hd, vs[size_t(s)].begin() + (h + 1) * hd), b(v.begin() + h * hd, v.begin() + (h + 1) * hd);
      kv_kernels::hadamard_ortho(a.data(), hd);
      kv_kernels::hadamard_ortho(b.data(), hd);
      float mx = 0;
      for (float x : a) mx = std::max(mx, std::fabs(x));
      // The scale is one of the bf16 candidates: absmax / s in [223, 429].
      for (int64_t i = 0; i < hd; ++i) {
        // E4M3: 3 mantissa bits, so half a step is <= 2^-4 of the value,
        // or half the subnormal step 2^-9 of the scale; scale <= mx / 223.
        const double tol = std::max(std::fabs(double(a[size_t(i)])) / 16.0, double(mx) / 223.0 / 1024.0) * 1.0001;
        ASSERT_LE(std::fabs(double(a[size_t(i)]) - b[size_t(i)]), tol) << s << " " << h << " " << i;
      }
    }
  }
  // The candidates are bf16 (V) and f24 (K) values: storing them so is
  // exact; f24 keeps 16 significant bits.
  for (int j = 0; j < fp8::kE4m3ScaleCandidates; ++j) {
    const float s = fp8::e4m3_scale_candidate_bf16(3.7f, j), s24 = fp8::e4m3_scale_candidate_f24(3.7f, j);
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(s)), s) << j;
    EXPECT_EQ(fp8::f24_to_f32(fp8::f32_to_f24(s24)), s24) << j;
    EXPECT_LE(3.7f / s, 448.0f) << j;
    EXPECT_NEAR(s / fp8::e4m3_scale_candidate(3.7f, j), 1.0, 1.0 / 256) << j;  // 8 significant bits
    EXPECT_NEAR(s24 / fp8::e4m3_scale_candidate(3.7f, j), 1.0, 1.0 / 40000) << j;  // 16 significant bits
  }
  EXPECT_EQ(fp8::f32_to_f24(1.0f), 0x3f8000u);
  EXPECT_EQ(fp8::f24_to_f32(fp8::f32_to_f24(1.0f + 0x80 * 0x1p-23f)), 1.0f);          // a tie: to even
  EXPECT_EQ(fp8::f24_to_f32(fp8::f32_to_f24(1.0f + 0x81 * 0x1p-23f)), 1.0f + 0x1p-15f);  // above: up
}

}  // namespace kv_fp8_channel_bytes_test
