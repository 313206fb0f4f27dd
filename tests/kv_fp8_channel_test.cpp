// FP8 KV with `--kv-fp8-scale channel`: `rotated`, with each rotated key
// stored minus a per-channel offset (the mean of the previous page of
// kFp8OffsetPage positions) and least-squares per-head scales. Checked by
// hand-derived scales, by keys whose offsets are known exactly (a broken or
// misplaced offset leaves the error of the whole key, not of its small
// variation), against the f32 cache, across prefix attention, copies
// (snapshots) and clear(), and through the CLI (CPU runs, CUDA refuses).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <sys/wait.h>
#include <vector>

#include "core/error.h"
#include "format/config.h"
#include "kv/fp8_e4m3.h"
#include "kv/kv_cache.h"
#include "kv/memory_calc.h"
#include "kv/presets.h"
#include "test_util.h"

namespace kv_fp8_channel_test {

using namespace flashmoe;
using flashmoe::test::naive_softmax_weights;

namespace {

using Vec = std::vector<float>;

KvConfig fp8(Fp8ScaleMode m) {
  KvConfig c;
  c.dtype = KvDType::FP8;
  c.fp8_scale = m;
  c.fp8_scale_set = true;
  return c;
}

double norm(const Vec& a, int64_t b, int64_t n) {
  double s = 0;
  for (int64_t i = b; i < b + n; ++i) s += double(a[size_t(i)]) * a[size_t(i)];
  return std::sqrt(s);
}

double dist(const Vec& a, const Vec& b, int64_t off, int64_t n) {
  double s = 0;
  for (int64_t i = off; i < off + n; ++i) s += (double(a[size_t(i)]) - b[size_t(i)]) * (double(a[size_t(i)]) - b[size_t(i)]);
  return std::sqrt(s);
}

// Keys as partially RoPE'd heads make them: most channels near a large
// per-channel constant, a small variation on top.
Vec offset_key(std::mt19937& rng, int64_t row, double spread) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Vec k(static_cast<size_t>(row));
  for (int64_t i = 0; i < row; ++i) k[size_t(i)] = 30.0f * std::sin(float(i) * 0.7f + 1.0f) + float(spread) * d(rng);
  return k;
}

Vec gauss(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Vec v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

bool has(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

struct RunResult {
  int status;
  std::string out;
};

RunResult run_cli(const std::string& args) {
  const std::string cmd = std::string(FLASHMOE_BINARY) + " " + args + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const int st = pclose(f);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

}  // namespace

// The scale search by hand: the candidates are absmax / 240, then absmax /
// (224 x 2^(j/16)), j = 0..15; only 240 and 224 (j = 0) store the absmax 1
// exactly (the others are irrational multiples of it).
TEST(Fp8MseScale, HandDerivedChoices) {
  // {1, 0.6}: with 240, 0.6 x 240 = 144 is an E4M3 value: no error, and 240
  // comes first.
  const float a[] = {1.0f, 0.6f};
  EXPECT_EQ(fp8::e4m3_mse_scale(a, 2), 1.0f / 240.0f);
  // {1, -120/224}: with 224 both are E4M3 values (224, 120); with 240 the
  // second is 128.57 (error 0.57/240), every other candidate misses the
  // absmax itself by ~1e-3 or more.
  const float b[] = {1.0f, -120.0f / 224.0f};
  EXPECT_EQ(fp8::e4m3_mse_scale(b, 2), 1.0f / 224.0f);
  const float z[] = {0.0f, -0.0f};
  EXPECT_EQ(fp8::e4m3_mse_scale(z, 2), 1.0f);
  // Never worse than the block scale (absmax / 240 is one of the nine).
  std::mt19937 rng(3);
  for (int t = 0; t < 50; ++t) {
    const Vec x = gauss(rng, 64);
    auto err = [&](float s) {
      double e = 0;
      for (float xi : x) {
        const double d = double(xi) - double(fp8::e4m3_decode(fp8::e4m3_encode(xi / s)) * s);
        e += d * d;
      }
      return e;
    };
    EXPECT_LE(err(fp8::e4m3_mse_scale(x.data(), 64)), err(fp8::e4m3_block_scale(x.data(), 64)));
  }
}

// Page 0 keys are one constant c, page 1 keys another constant c2; the
// first key of page 2 is c2 + r. Its offset is page 1's mean (exactly c2,
// rotated), so only r is rounded: |error| <= 2^-4 |r| (each element within
// half a step, at most 2^-4 of itself, of a rotation that keeps norms). An
// offset from the wrong page (c), or none, rounds |c2| ~ 100x larger.
TEST(KvFp8Channel, KeysAreRoundedAroundThePreviousPagesMean) {
  const int64_t nkv = 2, hd = 8, row = nkv * hd, P = kFp8OffsetPage;
  KvCache cache(nkv, hd, fp8(Fp8ScaleMode::Channel));
  Vec c(static_cast<size_t>(row)), c2(static_cast<size_t>(row)), r(static_cast<size_t>(row)), v(static_cast<size_t>(row));
  for (int64_t i = 0; i < row; ++i) {
    c[size_t(i)] = float(i % 5) * 16.0f - 40.0f;    // multiples of 8: page means are exact
    c2[size_t(i)] = float(i % 3) * 32.0f + 64.0f;
    r[size_t(i)] = 0.25f * float((i * 7) % 5) - 0.5f;
    v[size_t(i)] = float(i) - 7.5f;
  }
  int64_t pos = 0;
  for (; pos < P; ++pos) cache.append(pos, c.data(), v.data());
  for (; pos < 2 * P; ++pos) cache.append(pos, c2.data(), v.data());
  Vec k = c2;
  for (int64_t i = 0; i < row; ++i) k[size_t(i)] += r[size_t(i)];
  cache.append(pos, k.data(), v.data());

  Vec dk(static_cast<size_t>(row)), dv(static_cast<size_t>(row));
  cache.dequantize(2 * P, dk.data(), dv.data());
  for (int64_t h = 0; h < nkv; ++h) {
    EXPECT_LE(dist(dk, k, h * hd, hd), 0.0625 * norm(r, h * hd, hd) + 1e-4) << "head " << h;
    // V: rotated, least-squares scale: within 2^-4 of its norm.
    EXPECT_LE(dist(dv, v, h * hd, hd), 0.0625 * norm(v, h * hd, hd)) << "head " << h;
  }
  // Page 1 (offset c, so c2 - c is rounded) still decodes to within 2^-4 of
  // its rounded part; a page-1 key that is its own offset would be exact.
  Vec d = c2;
  for (int64_t i = 0; i < row; ++i) d[size_t(i)] -= c[size_t(i)];
  cache.dequantize(P + 3, dk.data(), dv.data());
  for (int64_t h = 0; h < nkv; ++h) EXPECT_LE(dist(dk, c2, h * hd, hd), 0.0625 * norm(d, h * hd, hd) + 1e-4);
  // Page 0 has no offset: rounded as a whole (rotated, least squares).
  cache.dequantize(0, dk.data(), dv.data());
  for (int64_t h = 0; h < nkv; ++h) EXPECT_LE(dist(dk, c, h * hd, hd), 0.0625 * norm(c, h * hd, hd));
}

// Against the f32 cache, keys with large per-channel constants: `channel`
// rounds only their variation, `rotated` rounds the whole key; the
// attention output's error must be far below rotated's, and the attention
// must be the one over its own decoded rows (rotation of q and of the
// output, offsets in the decoding). Prefix attention gives the same bits.
TEST(KvFp8Channel, AttentionAgainstF32AndItsOwnRows) {
  const int64_t nkv = 2, hd = 64, nh = 4, row = nkv * hd, n = 600;
  std::mt19937 rng(11);
  KvConfig f32;
  KvCache ref(nkv, hd, f32), rot(nkv, hd, fp8(Fp8ScaleMode::Rotated)), ch(nkv, hd, fp8(Fp8ScaleMode::Channel));
  for (int64_t p = 0; p < n; ++p) {
    const Vec k = offset_key(rng, row, 1.0), v = gauss(rng, row);
    ref.append(p, k.data(), v.data());
    rot.append(p, k.data(), v.data());
    ch.append(p, k.data(), v.data());
  }
  std::vector<Vec> dk, dv;
  Vec k(static_cast<size_t>(row)), v(static_cast<size_t>(row));
  for (int64_t s = 0; s < n; ++s) {
    ch.dequantize(s, k.data(), v.data());
    dk.push_back(k);
    dv.push_back(v);
  }
  const float scale = 0.125f;
  double err_ch = 0, err_rot = 0;
  for (int trial = 0; trial < 4; ++trial) {
    const Vec q = gauss(rng, nh * hd);
    Vec o_ref(static_cast<size_t>(nh * hd)), o_rot(o_ref), o_ch(o_ref), o_pre(o_ref), o_own(o_ref.size(), 0.0f);
    ref.attend(q.data(), nh, scale, o_ref.data());
    rot.attend(q.data(), nh, scale, o_rot.data());
    ch.attend(q.data(), nh, scale, o_ch.data());
    KvCache::AttendScratch sc;
    ch.attend_prefix(q.data(), nh, scale, o_pre.data(), n, sc);
    ASSERT_EQ(std::memcmp(o_pre.data(), o_ch.data(), o_ch.size() * 4), 0) << "trial " << trial;
    for (int64_t h = 0; h < nh; ++h) {  // naive softmax over the decoded rows
      const int64_t kvh = h / (nh / nkv);
      const std::vector<double> p = naive_softmax_weights(q.data() + h * hd, dk, kvh, hd, n, scale);
      for (int64_t s = 0; s < n; ++s)
        for (int64_t i = 0; i < hd; ++i)
          o_own[size_t(h * hd + i)] += float(p[size_t(s)] * dv[size_t(s)][size_t(kvh * hd + i)]);
    }
    for (size_t i = 0; i < o_ch.size(); ++i) ASSERT_NEAR(o_ch[i], o_own[i], 1e-4) << "trial " << trial << " i " << i;
    err_ch = std::max(err_ch, dist(o_ch, o_ref, 0, nh * hd));
    err_rot = std::max(err_rot, dist(o_rot, o_ref, 0, nh * hd));
  }
  // Page 0 (offset 0) is rounded whole in both; the rest is not.
  EXPECT_LT(err_ch, 0.7 * err_rot) << "channel " << err_ch << " rotated " << err_rot;
  // Per key, beyond page 0: the variation (norm ~8 per head) is rounded
  // instead of the whole key (norm ~170): a wrong offset fails this.
  double ech = 0, erot = 0;
  Vec rk(static_cast<size_t>(row)), rv(rk), fk(rk), fv(rk);
  for (int64_t s = kFp8OffsetPage; s < n; ++s) {
    rot.dequantize(s, rk.data(), rv.data());
    ref.dequantize(s, fk.data(), fv.data());
    ech += dist(dk[size_t(s)], fk, 0, row);
    erot += dist(rk, fk, 0, row);
  }
  EXPECT_LT(ech, 0.15 * erot) << "channel " << ech << " rotated " << erot;
}

// A copy (what a state snapshot holds) continues exactly as the original,
// across a page boundary; clear() and the same appends give the same bits.
TEST(KvFp8Channel, CopiesAndClearReproduceTheSameBits) {
  const int64_t nkv = 1, hd = 16, nh = 2, row = nkv * hd, P = kFp8OffsetPage;
  std::mt19937 rng(7);
  std::vector<Vec> ks, vs;
  for (int64_t p = 0; p < P + 40; ++p) {
    ks.push_back(offset_key(rng, row, 2.0));
    vs.push_back(gauss(rng, row));
  }
  const Vec q = gauss(rng, nh * hd);
  KvCache a(nkv, hd, fp8(Fp8ScaleMode::Channel));
  for (int64_t p = 0; p < P - 10; ++p) a.append(p, ks[size_t(p)].data(), vs[size_t(p)].data());
  KvCache b = a;  // snapshot mid-page
  for (int64_t p = P - 10; p < P + 40; ++p) {
    a.append(p, ks[size_t(p)].data(), vs[size_t(p)].data());
    b.append(p, ks[size_t(p)].data(), vs[size_t(p)].data());
  }
  Vec oa(static_cast<size_t>(nh * hd)), ob(oa), oc(oa);
  a.attend(q.data(), nh, 0.25f, oa.data());
  b.attend(q.data(), nh, 0.25f, ob.data());
  EXPECT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * 4), 0);
  a.clear();
  EXPECT_EQ(a.size(), 0);
  for (int64_t p = 0; p < P + 40; ++p) a.append(p, ks[size_t(p)].data(), vs[size_t(p)].data());
  a.attend(q.data(), nh, 0.25f, oc.data());
  EXPECT_EQ(std::memcmp(oc.data(), ob.data(), oc.size() * 4), 0);
  // quest over the same keys reads every slot while they fit: the same bits.
  KvConfig qc = fp8(Fp8ScaleMode::Channel);
  qc.resident = 1024;
  qc.page = 16;
  KvCache quest(nkv, hd, qc);
  for (int64_t p = 0; p < P + 40; ++p) quest.append(p, ks[size_t(p)].data(), vs[size_t(p)].data());
  quest.attend(q.data(), nh, 0.25f, oc.data());
  EXPECT_EQ(std::memcmp(oc.data(), ob.data(), oc.size() * 4), 0);
}

TEST(KvFp8Channel, ConfigurationAndErrors) {
  EXPECT_EQ(parse_fp8_scale_mode("channel"), Fp8ScaleMode::Channel);
  EXPECT_STREQ(fp8_scale_mode_name(Fp8ScaleMode::Channel), "channel");
  EXPECT_EQ(fp8(Fp8ScaleMode::Channel).describe(), "dtype=fp8 fp8-scale=channel full");
  KvConfig w = fp8(Fp8ScaleMode::Channel);
  w.window = 64;
  w.window_set = true;
  try {
    w.validate();
    ADD_FAILURE() << "channel with a window accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "--kv-fp8-scale channel needs the full cache or --kv-resident")) << e.what();
  }
  KvConfig s = fp8(Fp8ScaleMode::Channel);
  s.snapkv_budget = 64;
  EXPECT_THROW(s.validate(), Error);
  try {
    KvCache c(2, 48, fp8(Fp8ScaleMode::Channel));
    ADD_FAILURE() << "head_dim 48 accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "channel needs a power-of-two head_dim")) << e.what();
  }
  // kv-calc: per-head scales (3 B f24 for K, 2 B bf16 for V), 4 B per key
  // channel per page, and per sequence the queries' second moment (a
  // packed f32 triangle per layer and KV head) and the current page's key
  // sums (4 B per key channel).
  const ModelConfig m = model_preset("qwen3.5-35b-a3b");  // 10 layers x 2 KV heads x 256
  const KvMemory mem = kv_memory(m, fp8(Fp8ScaleMode::Channel));
  EXPECT_EQ(mem.bytes_per_position(), 10 * 1024 + 10 * 2 * (3 + 2));
  EXPECT_EQ(mem.offset_bytes_per_page, 10 * 2 * 256 * 4);
  const int64_t seq = 10 * 2 * (256 * 257 / 2) * 4 + 10 * 2 * 256 * 4;  // 2,631,680 + 20,480
  EXPECT_EQ(mem.sequence_bytes(), seq);
  EXPECT_EQ(kv_cache_bytes(m, fp8(Fp8ScaleMode::Channel), 4096), 10340 * 4096 + 16 * 20480 + seq);
  EXPECT_EQ(kv_cache_bytes(m, fp8(Fp8ScaleMode::Channel), 257), 10340 * 257 + 2 * 20480 + seq);
}

// Refused with a policy that moves slots (the offsets are per page of
// slots); kv-calc reports its bytes. (On the CPU it runs and on CUDA it is
// refused by name: KvFp8TransformCli in kv_calc_test.cpp.)
TEST(KvFp8ChannelCli, NeedsTheFullCacheAndKvCalcCountsItsOffsets) {
  const std::string m = std::string(FLASHMOE_SOURCE_DIR) + "/tests/fixtures/tiny-qwen35moe/model";
  const std::string o = ::testing::TempDir() + "kv_fp8_channel_logits.safetensors";
  RunResult r;
  r = run_cli("logits -m " + m + " --device cpu --kv-dtype fp8 --kv-fp8-scale channel --kv-window 8 --ids 1,2,3 -o " + o);
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "--kv-fp8-scale channel needs the full cache or --kv-resident")) << r.out;
  r = run_cli("kv-calc --preset qwen3.5-35b-a3b --kv-dtype fp8 --kv-fp8-scale channel --context 4096");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "KV per position: 10340 B")) << r.out;
  EXPECT_TRUE(has(r.out, "+ 20480 B key offsets per page of 256 positions")) << r.out;
  EXPECT_TRUE(has(r.out, "KV per sequence (in the KV cache column, whatever the context): 2652160 B")) << r.out;
  EXPECT_TRUE(has(r.out, "43.23 MiB")) << r.out;  // 4096 x 10340 + 16 x 20480 + 2,652,160 = 45,332,480 B
}

}  // namespace kv_fp8_channel_test
