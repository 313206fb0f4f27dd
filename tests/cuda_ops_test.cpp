// Single CUDA kernels of the decode step against the CPU's ops on random
// inputs (backend/cuda/op_check.h), op by op, the way ggml's
// test-backend-ops checks a backend: the matvec in every storage type, with
// and without the fused norm, 2 and 3 rows per warp; the router's top-k;
// the gated delta-rule step, one block per head and in clusters; decode
// attention over a KV cache (f32, bf16, f16), one block or a cluster per
// head; the routed experts in q8/q4 and in FP8 blocks, and the batched
// step's experts over few rows per expert. Skipped where no GPU is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/gated_delta.h"
#include "backend/cpu/matmul.h"
#include "core/matrix_rows.h"
#include "backend/cpu/ops.h"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/op_check.h"
#include "core/dtype.h"
#include "test_util.h"

namespace cuda_ops_test {

using namespace flashmoe;

namespace {

std::vector<float> normal(std::mt19937& rng, size_t n, float sd) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The largest |a - b| relative to 1 + the largest |b|.
float rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  float e = 0.f, m = 0.f;
  for (size_t i = 0; i < b.size(); ++i) {
    e = std::max(e, std::fabs(a[i] - b[i]));
    m = std::max(m, std::fabs(b[i]));
  }
  return e / (1.f + m);
}

TEST(CudaOps, MatvecMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  struct Shape {
    int rows, cols;
  };
  // Few rows (split over warps), a row count that leaves 3 per warp,
  // columns beyond the registers of the norm's preload (2048).
  for (Shape s : {Shape{37, 64}, Shape{1000, 2048}, Shape{2100, 512}, Shape{64, 4096}})
    for (DType t : {DType::F32, DType::F16, DType::BF16})
      for (bool norm : {false, true})
        for (bool three : {false, true}) {
          const size_t n = size_t(s.rows) * s.cols;
          const std::vector<float> wf = normal(rng, n, 1.0f / std::sqrt(float(s.cols)));
          std::vector<float> w32(n);
          std::vector<uint16_t> w16(n);
          for (size_t i = 0; i < n; ++i) {
            if (t == DType::F16) w16[i] = f32_to_f16(wf[i]);
            else if (t == DType::BF16) w16[i] = f32_to_bf16(wf[i]);
            else w32[i] = wf[i];
          }
          Matrix W;
          W.dtype = t;
          W.data = t == DType::F32 ? static_cast<const void*>(w32.data()) : static_cast<const void*>(w16.data());
          W.rows = s.rows;
          W.cols = s.cols;
          const std::vector<float> x = normal(rng, size_t(s.cols), 1.0f);
          const std::vector<float> nw = norm ? normal(rng, size_t(s.cols), 0.1f) : std::vector<float>{};
          const float eps = 1e-6f;
          std::vector<float> xn = x, want(static_cast<size_t>(s.rows));
          if (norm) cpu::rmsnorm_zc(x.data(), nw.data(), s.cols, eps, xn.data());
          cpu::matmul_serial(W, xn.data(), 1, s.cols, want.data(), s.rows);
          const std::vector<float> got = cuda_ops::matvec(W, x, nw, eps, three);
          ASSERT_EQ(got.size(), want.size());
          const float e = rel_err(got, want);
          EXPECT_LE(e, 1e-5f) << dtype_name(t) << " " << s.rows << "x" << s.cols << " norm " << norm << " three "
                              << three;
        }
}

TEST(CudaOps, TopkMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  struct Case {
    int E, k;
    bool norm, shared;
  };
  for (Case c : {Case{16, 4, false, false}, Case{64, 8, true, true}, Case{256, 8, true, true},
                 Case{512, 10, true, false}, Case{512, 32, false, true}}) {
    for (int rep = 0; rep < 4; ++rep) {
      const std::vector<float> logits = normal(rng, size_t(c.E) + (c.shared ? 1 : 0), 2.0f);
      // CPU: softmax over the E experts, the k largest (ties: lower index).
      std::vector<float> p(logits.begin(), logits.begin() + c.E);
      cpu::softmax(p.data(), c.E);
      std::vector<int> order(static_cast<size_t>(c.E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[size_t(a)] > p[size_t(b)]; });
      std::vector<int> want_ids(order.begin(), order.begin() + c.k);
      float sum = 0.f;
      for (int e : want_ids) sum += p[size_t(e)];
      std::vector<float> want_w;
      for (int e : want_ids) want_w.push_back(c.norm ? p[size_t(e)] / sum : p[size_t(e)]);
      if (c.shared) want_w.push_back(cpu::sigmoid(logits[size_t(c.E)]));
      std::vector<int> ids;
      std::vector<float> w;
      cuda_ops::topk(logits, c.E, c.k, c.norm, c.shared, &ids, &w);
      const std::string what = "E " + std::to_string(c.E) + " k " + std::to_string(c.k);
      EXPECT_EQ(ids, want_ids) << what;
      ASSERT_EQ(w.size(), want_w.size()) << what;
      EXPECT_LE(rel_err(w, want_w), 1e-5f) << what;
    }
  }
}

TEST(CudaOps, GatedDeltaStepMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(13);
  struct Case {
    int nk, nv, dk, dv;
  };
  for (Case c : {Case{2, 4, 32, 32}, Case{2, 4, 64, 64}, Case{1, 2, 128, 64}, Case{2, 2, 128, 128}, Case{1, 1, 48, 40}})
    for (bool cluster : {false, true}) {
      if (cluster && (c.dv % 8 || c.dv > 64 || (c.dk != 32 && c.dk != 64 && c.dk != 128))) continue;
      cuda_ops::DeltaStep d;
      d.nk = c.nk, d.nv = c.nv, d.dk = c.dk, d.dv = c.dv;
      const size_t C = size_t(2 * c.nk * c.dk + c.nv * c.dv), VD = size_t(c.nv) * c.dv;
      d.z = normal(rng, VD, 1.f);
      d.b = normal(rng, size_t(c.nv), 1.f);
      d.a = normal(rng, size_t(c.nv), 1.f);
      d.dt_bias = normal(rng, size_t(c.nv), 0.5f);
      d.neg_exp_A = normal(rng, size_t(c.nv), 0.5f);
      for (float& v : d.neg_exp_A) v = -std::exp(v);
      d.norm_w = normal(rng, size_t(c.dv), 0.2f);
      for (float& v : d.norm_w) v += 1.f;
      d.S = normal(rng, VD * size_t(c.dk), 0.1f);
      std::vector<float> S = d.S;  // the CPU's copy
      const std::string what = std::to_string(c.nk) + "/" + std::to_string(c.nv) + " heads, dk " +
                               std::to_string(c.dk) + ", dv " + std::to_string(c.dv) + (cluster ? ", cluster" : "");
      for (int step = 0; step < 3; ++step) {
        d.conv = normal(rng, C, 1.f);
        // CPU, as the linear-attention block: q/k l2-normed per key head (q
        // also by 1/sqrt(dk)), then per value head the recurrence and the
        // gated norm.
        std::vector<float> cv = d.conv, want(VD), oh(static_cast<size_t>(c.dv)), m(static_cast<size_t>(c.dv));
        for (int g = 0; g < c.nk; ++g) {
          cpu::l2norm(cv.data() + g * c.dk, c.dk, 1e-6f, 1.0f / std::sqrt(float(c.dk)));
          cpu::l2norm(cv.data() + c.nk * c.dk + g * c.dk, c.dk, 1e-6f, 1.0f);
        }
        for (int h = 0; h < c.nv; ++h) {
          const int g = h / (c.nv / c.nk);
          const float beta = cpu::sigmoid(d.b[size_t(h)]);
          const float decay = std::exp(d.neg_exp_A[size_t(h)] * cpu::softplus(d.a[size_t(h)] + d.dt_bias[size_t(h)]));
          cpu::gated_delta_step(S.data() + size_t(h) * c.dk * c.dv, cv.data() + g * c.dk,
                                cv.data() + c.nk * c.dk + g * c.dk, cv.data() + 2 * c.nk * c.dk + h * c.dv, decay,
                                beta, c.dk, c.dv, oh.data(), m.data());
          cpu::rmsnorm_gated(oh.data(), d.norm_w.data(), d.z.data() + size_t(h) * c.dv, c.dv, d.eps,
                             want.data() + size_t(h) * c.dv);
        }
        const std::vector<float> got = cuda_ops::delta_step(d, cluster);
        EXPECT_LE(rel_err(got, want), 1e-4f) << what << ", step " << step;
        EXPECT_LE(rel_err(d.S, S), 1e-5f) << what << ", step " << step << " (state)";
      }
    }
}

TEST(CudaOps, DecodeAttentionMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  struct Case {
    int nh, nkv, hd, n;
  };
  // hd 40: the kernel's scalar path (no split there).
  for (Case c : {Case{4, 2, 64, 1}, Case{8, 2, 128, 37}, Case{16, 2, 256, 300}, Case{2, 1, 40, 20}})
    for (cuda_ops::KvStore kv : {cuda_ops::KvStore::F32, cuda_ops::KvStore::BF16, cuda_ops::KvStore::F16})
      for (int split : {1, 4})
        for (bool prefetch : {false, true}) {
          if (split > 1 && c.hd % 8) continue;
          cuda_ops::AttnDecode a;
          a.nh = c.nh, a.nkv = c.nkv, a.hd = c.hd, a.n = c.n, a.kv = kv;
          const size_t qn = size_t(c.nh) * c.hd, kn = size_t(c.n) * c.nkv * c.hd;
          a.q = normal(rng, qn, 1.f);
          a.gate = normal(rng, qn, 1.f);
          a.k = normal(rng, kn, 1.f);
          a.v = normal(rng, kn, 1.f);
          // CPU on the values as stored.
          std::vector<float> k = a.k, v = a.v;
          for (size_t i = 0; i < kn; ++i) {
            if (kv == cuda_ops::KvStore::BF16) k[i] = bf16_to_f32(f32_to_bf16(k[i])), v[i] = bf16_to_f32(f32_to_bf16(v[i]));
            if (kv == cuda_ops::KvStore::F16) k[i] = f16_to_f32(f32_to_f16(k[i])), v[i] = f16_to_f32(f32_to_f16(v[i]));
          }
          std::vector<float> want(qn), p(static_cast<size_t>(c.n));
          const float scale = 1.0f / std::sqrt(float(c.hd));
          for (int h = 0; h < c.nh; ++h) {
            const int kvh = h / (c.nh / c.nkv);
            for (int t = 0; t < c.n; ++t) {
              float d = 0.f;
              for (int i = 0; i < c.hd; ++i) d += a.q[size_t(h) * c.hd + i] * k[(size_t(t) * c.nkv + kvh) * c.hd + i];
              p[size_t(t)] = d * scale;
            }
            cpu::softmax(p.data(), c.n);
            for (int i = 0; i < c.hd; ++i) {
              float o = 0.f;
              for (int t = 0; t < c.n; ++t) o += p[size_t(t)] * v[(size_t(t) * c.nkv + kvh) * c.hd + i];
              want[size_t(h) * c.hd + i] = o * cpu::sigmoid(a.gate[size_t(h) * c.hd + i]);
            }
          }
          const std::vector<float> got = cuda_ops::attention(a, split, prefetch);
          ASSERT_EQ(got.size(), want.size());
          EXPECT_LE(rel_err(got, want), 1e-4f) << c.nh << "/" << c.nkv << " heads, hd " << c.hd << ", " << c.n
                                               << " positions, kv " << int(kv) << ", split " << split
                                               << ", prefetch " << prefetch;
        }
}

// A random q8/q4 matrix (codes, bf16 scales and biases spreading the
// weights over about [-r, r], r = 1/sqrt(cols)), its storage in `store`.
struct QStore {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scales, biases;
};
Matrix random_quant(std::mt19937& rng, int bits, int group, int rows, int cols, QStore* store) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> jitter(0.5f, 1.5f);
  store->codes.resize(size_t(rows) * cols * bits / 8);
  for (uint8_t& c : store->codes) c = uint8_t(byte(rng));
  const size_t ng = size_t(rows) * (cols / group);
  const float r = 1.0f / std::sqrt(float(cols)), top = float((1 << bits) - 1);
  store->scales.resize(ng);
  store->biases.resize(ng);
  for (size_t i = 0; i < ng; ++i) {
    store->scales[i] = f32_to_bf16(2 * r / top * jitter(rng));
    store->biases[i] = f32_to_bf16(-r * jitter(rng));
  }
  Matrix m;
  m.data = store->codes.data();
  m.rows = rows;
  m.cols = cols;
  m.quant = bits == 8 ? QuantKind::Q8 : QuantKind::Q4;
  m.scales = store->scales.data();
  m.biases = store->biases.data();
  m.group = group;
  return m;
}

TEST(CudaOps, QuantExpertsMatchCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(19);
  struct Case {
    int bits, group, H, I, k;
  };
  // q4 in groups of 16: a 16-byte chunk of codes spans two groups.
  for (Case c : {Case{8, 64, 256, 128, 4}, Case{4, 64, 512, 256, 8}, Case{4, 32, 256, 128, 2}, Case{4, 16, 256, 128, 4},
                 Case{8, 32, 2048, 512, 8}}) {
    std::vector<QStore> store(size_t(3 * c.k));
    std::vector<cuda_ops::QuantExpert> experts;
    for (int j = 0; j < c.k; ++j)
      experts.push_back({random_quant(rng, c.bits, c.group, c.I, c.H, &store[size_t(3 * j)]),
                         random_quant(rng, c.bits, c.group, c.I, c.H, &store[size_t(3 * j + 1)]),
                         random_quant(rng, c.bits, c.group, c.H, c.I, &store[size_t(3 * j + 2)])});
    const std::vector<float> x = normal(rng, size_t(c.H), 1.f), nw = normal(rng, size_t(c.H), 0.1f);
    std::vector<float> w = normal(rng, size_t(c.k), 0.3f);
    for (float& v : w) v = std::fabs(v);
    const float eps = 1e-6f;
    // CPU: the dequantised dot of every row (core/matrix_rows).
    std::vector<float> xn(x.size()), want = x, h(static_cast<size_t>(c.I));
    cpu::rmsnorm_zc(x.data(), nw.data(), c.H, eps, xn.data());
    for (int j = 0; j < c.k; ++j) {
      const cuda_ops::QuantExpert& e = experts[size_t(j)];
      for (int r = 0; r < c.I; ++r)
        h[size_t(r)] = cpu::silu(cpu::quant_dot_row(e.gate, r, xn.data())) * cpu::quant_dot_row(e.up, r, xn.data());
      for (int r = 0; r < c.H; ++r) want[size_t(r)] += w[size_t(j)] * cpu::quant_dot_row(e.down, r, h.data());
    }
    const std::vector<float> got = cuda_ops::quant_experts(experts, w, x, nw, eps);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_LE(rel_err(got, want), 1e-4f) << "q" << c.bits << " group " << c.group << ", H " << c.H << ", I " << c.I
                                         << ", k " << c.k;
  }
}

// A random FP8 block matrix (E4M3 codes, all but the NaN codes 0x7F/0xFF;
// fp32 scales per block of block_rows x group weights, spreading the
// weights over about [-r, r], r = 1/sqrt(cols)), its storage in `store`.
struct F8Store {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
Matrix random_fp8(std::mt19937& rng, int block_rows, int group, int rows, int cols, F8Store* store) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> jitter(0.5f, 1.5f);
  store->codes.resize(size_t(rows) * cols);
  for (uint8_t& c : store->codes) {
    c = uint8_t(byte(rng));
    if ((c & 0x7F) == 0x7F) c &= 0xFE;
  }
  const int nbr = (rows + block_rows - 1) / block_rows, nbc = (cols + group - 1) / group;
  store->scales.resize(size_t(nbr) * nbc);
  // Random codes average |value| ~50: scales of ~1/(60 sqrt(cols)) give
  // weights near 1/sqrt(cols) on average.
  for (float& v : store->scales) v = jitter(rng) / (60.0f * std::sqrt(float(cols)));
  Matrix m;
  m.data = store->codes.data();
  m.rows = rows;
  m.cols = cols;
  m.quant = QuantKind::Fp8Block;
  m.block_scales = store->scales.data();
  m.group = group;
  m.block_rows = block_rows;
  return m;
}

// The FP8 expert kernels against the CPU's FP8 rows (core/fp8_rows.cpp
// decodes every code exactly), each path as CudaModel::Impl::moe_launch_q
// picks it. gate_up by whole rows through shared memory
// (gate_up_fp8_smem_kernel, sizes a multiple of 512) before the tensor-core
// down: the 35B's shapes in 128 x 128 blocks with and without the FP8
// shared expert, two steps a row (1,024) in blocks of 32 x 64, and 32
// experts of a 4,096 hidden size (more warps than one resident wave: warps
// take rows again). The tensor cores for both (gate_up_fp8_mma_kernel,
// down_fp8_mma_kernel): sizes that leave partial blocks and steps (an expert
// of 64, 80 or 112 columns, a hidden size of 208 in blocks of 64), one with
// a shared expert; blocks of 32 x 48 on the FFMA kernels
// (gate_up_fp8_kernel, down_fp8_kernel).
TEST(CudaOps, Fp8ExpertsMatchCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(23);
  struct Case {
    int block_rows, group, H, I, k, Is;  // Is: the shared expert's size (0: none)
  };
  for (Case c : {Case{128, 128, 2048, 512, 8, 0}, Case{128, 128, 2048, 512, 8, 512}, Case{32, 64, 1024, 1024, 3, 512},
                 Case{128, 128, 4096, 512, 32, 0}, Case{128, 128, 128, 64, 4, 0}, Case{128, 128, 256, 80, 2, 0},
                 Case{128, 128, 256, 80, 2, 96}, Case{64, 64, 208, 112, 3, 0}, Case{32, 48, 192, 96, 3, 0}}) {
    std::vector<F8Store> store(size_t(3 * c.k + 3));
    std::vector<cuda_ops::QuantExpert> experts;
    for (int j = 0; j < c.k; ++j)
      experts.push_back({random_fp8(rng, c.block_rows, c.group, c.I, c.H, &store[size_t(3 * j)]),
                         random_fp8(rng, c.block_rows, c.group, c.I, c.H, &store[size_t(3 * j + 1)]),
                         random_fp8(rng, c.block_rows, c.group, c.H, c.I, &store[size_t(3 * j + 2)])});
    // The shared expert as the upload keeps DT_FP8 matrices: per-row scales
    // (one block row per row here, so every row has scales of its own).
    cuda_ops::QuantExpert sh;
    if (c.Is)
      sh = {random_fp8(rng, 1, c.group, c.Is, c.H, &store[size_t(3 * c.k)]),
            random_fp8(rng, 1, c.group, c.Is, c.H, &store[size_t(3 * c.k + 1)]),
            random_fp8(rng, 1, c.group, c.H, c.Is, &store[size_t(3 * c.k + 2)])};
    const std::vector<float> x = normal(rng, size_t(c.H), 1.f), nw = normal(rng, size_t(c.H), 0.1f);
    std::vector<float> w = normal(rng, size_t(c.k + (c.Is ? 1 : 0)), 0.3f);
    for (float& v : w) v = std::fabs(v);
    const float eps = 1e-6f;
    std::vector<float> xn(x.size()), want = x;
    cpu::rmsnorm_zc(x.data(), nw.data(), c.H, eps, xn.data());
    for (int j = 0; j < c.k + (c.Is ? 1 : 0); ++j) {
      const cuda_ops::QuantExpert& e = j < c.k ? experts[size_t(j)] : sh;
      const int n = j < c.k ? c.I : c.Is;
      std::vector<float> h(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r)
        h[size_t(r)] = cpu::silu(cpu::quant_dot_row(e.gate, r, xn.data())) * cpu::quant_dot_row(e.up, r, xn.data());
      for (int r = 0; r < c.H; ++r) want[size_t(r)] += w[size_t(j)] * cpu::quant_dot_row(e.down, r, h.data());
    }
    const std::vector<float> got = cuda_ops::quant_experts(experts, w, x, nw, eps, c.Is ? &sh : nullptr);
    ASSERT_EQ(got.size(), want.size());
    // A wrong scale block or code decode moves the result by far more.
    EXPECT_LE(rel_err(got, want), 1e-4f) << "fp8 blocks " << c.block_rows << "x" << c.group << ", H " << c.H << ", I "
                                         << c.I << ", k " << c.k << ", shared " << c.Is;
    EXPECT_GT(rel_err(x, want), 1e-2f);  // the experts did move x (well past the tolerance)
  }
}

// The FP8 matvec against the CPU's FP8 rows, each path as
// CudaModel::Impl::matvec_fp8 picks it: whole rows per warp
// (matvec_fp8_rows_kernel, columns a multiple of 256) at the 35B's
// projection shapes in 128 x 128 blocks (few rows: split over warps), 8192
// columns, more rows than one resident wave (20,000); the tensor cores
// (matvec_fp8_mma_kernel) for rows not a multiple of the 16-row tile and
// columns not of the block (208: a partial block and a partial step); the
// FFMA kernel (matvec_fp8_kernel) for partial blocks of 48 columns; and a
// slice starting 37 rows into its block row (the per-row scales a stacked
// device matrix carries).
TEST(CudaOps, Fp8MatvecMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(29);
  struct Shape {
    int rows, cols, block_rows, group;
  };
  for (Shape s : {Shape{4096, 2048, 128, 128}, Shape{1024, 4096, 128, 128}, Shape{37, 256, 128, 128},
                  Shape{100, 208, 128, 128}, Shape{64, 8192, 128, 128}, Shape{53248, 256, 128, 128},
                  Shape{20000, 2048, 128, 128}, Shape{300, 80, 32, 48}})
    for (bool norm : {false, true})
      for (bool three : {false, true})
        for (int r0 : {0, 37}) {
          if (r0 >= s.rows) continue;
          F8Store store;
          const Matrix full = random_fp8(rng, s.block_rows, s.group, s.rows, s.cols, &store);
          const Matrix W = full.slice_rows(r0, s.rows - r0);
          const std::vector<float> x = normal(rng, size_t(s.cols), 1.0f);
          const std::vector<float> nw = norm ? normal(rng, size_t(s.cols), 0.1f) : std::vector<float>{};
          const float eps = 1e-6f;
          std::vector<float> xn = x, want(static_cast<size_t>(W.rows));
          if (norm) cpu::rmsnorm_zc(x.data(), nw.data(), s.cols, eps, xn.data());
          for (int64_t r = 0; r < W.rows; ++r) want[size_t(r)] = cpu::quant_dot_row(W, r, xn.data());
          const std::vector<float> got = cuda_ops::matvec(W, x, nw, eps, three);
          ASSERT_EQ(got.size(), want.size());
          EXPECT_LE(rel_err(got, want), 1e-5f) << s.rows << "x" << s.cols << " blocks " << s.block_rows << "x"
                                               << s.group << " from row " << r0 << " norm " << norm << " three "
                                               << three;
        }
}

}  // namespace

// The batched step's routed experts at a few rows per picked expert
// (few_rows_kernel) against plain double sums over the CPU's rows
// (core/matrix_rows load_row): the 35B's expert shape and small ones, in
// bf16, f16 and f32; experts picked by no row, by one, and by more rows
// than one tile holds (every row picks expert 0).
TEST(CudaOps, FewRowsExpertsMatchCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(29);
  struct Case {
    DType dt;
    int H, I, E, k, T;
  };
  for (Case c : {Case{DType::BF16, 2048, 512, 16, 8, 6}, Case{DType::BF16, 256, 128, 8, 2, 1},
                 Case{DType::BF16, 256, 128, 8, 3, 11}, Case{DType::F16, 256, 64, 6, 2, 5},
                 Case{DType::F32, 128, 96, 4, 2, 3}}) {
    const size_t es = dtype_size(c.dt);
    std::vector<std::vector<uint8_t>> store;
    auto matrix = [&](int rows, int cols) {
      const std::vector<float> v = normal(rng, size_t(rows) * cols, 1.f / std::sqrt(float(cols)));
      store.emplace_back(v.size() * es);
      uint8_t* d = store.back().data();
      for (size_t i = 0; i < v.size(); ++i) {
        if (c.dt == DType::F32) std::memcpy(d + 4 * i, &v[i], 4);
        else {
          const uint16_t h = c.dt == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
          std::memcpy(d + 2 * i, &h, 2);
        }
      }
      Matrix m;
      m.dtype = c.dt;
      m.data = d;
      m.rows = rows;
      m.cols = cols;
      return m;
    };
    store.reserve(size_t(2 * c.E));
    std::vector<cuda_ops::DenseExpert> experts;
    for (int e = 0; e < c.E; ++e) experts.push_back({matrix(2 * c.I, c.H), matrix(c.H, c.I)});
    // Each row picks expert 0 and k - 1 others of 1..E-2: E-1 is never picked.
    std::vector<int> ids;
    for (int t = 0; t < c.T; ++t) {
      std::vector<int> others(size_t(c.E - 2));
      std::iota(others.begin(), others.end(), 1);
      std::shuffle(others.begin(), others.end(), rng);
      ids.push_back(0);
      for (int j = 1; j < c.k; ++j) ids.push_back(others[size_t(j - 1)]);
      std::shuffle(ids.end() - c.k, ids.end(), rng);
    }
    const std::vector<float> x = normal(rng, size_t(c.T) * c.H, 1.f);
    std::vector<float> want(size_t(c.T) * c.k * c.H), row(static_cast<size_t>(std::max(c.H, c.I)));
    std::vector<double> h(static_cast<size_t>(c.I));
    for (int i = 0; i < c.T * c.k; ++i) {
      const cuda_ops::DenseExpert& e = experts[size_t(ids[size_t(i)])];
      const float* xt = x.data() + size_t(i / c.k) * c.H;
      auto dot = [&](const Matrix& W, int r, const double* xd, const float* xf) {
        cpu::load_row(W, r, row.data());
        double s = 0;
        for (int64_t j = 0; j < W.cols; ++j) s += double(row[size_t(j)]) * (xd ? xd[j] : double(xf[j]));
        return s;
      };
      for (int r = 0; r < c.I; ++r) {
        const double g = dot(e.gate_up, r, nullptr, xt), u = dot(e.gate_up, c.I + r, nullptr, xt);
        h[size_t(r)] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int r = 0; r < c.H; ++r) want[size_t(i) * c.H + r] = float(dot(e.down, r, h.data(), nullptr));
    }
    const std::vector<float> got = cuda_ops::few_rows_experts(experts, x, c.T, ids, c.k);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_LE(rel_err(got, want), 1e-5f) << dtype_name(c.dt) << " H " << c.H << ", I " << c.I << ", E " << c.E
                                         << ", k " << c.k << ", T " << c.T;
  }
}

// The batched step's dense product of a few rows (skinny_gemm_kernel)
// against a double-precision product of the same bf16 weights, element by
// element within the split-bf16 activations' bound (2^-15 of the sum of
// |a_k w_k| per product): every row count's token tiles (1, 5, 17, 32, 33,
// 64 rows), K split over clusters of 2 to 8 blocks (some with no columns
// left) and not split at all, rows and K not multiples of the tiles, and
// the three modes (store, add onto C, swiglu of gate/up row pairs). With
// the activations handed over split (as the batched step's norms leave
// them) the kernel must give the same bits, and swiglu's split output must
// be the host's split of its result.
TEST(CudaOps, SkinnyProductMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(31);
  struct Case {
    int T, N, K, mode;
  };
  for (Case c : {Case{1, 300, 520, 0}, Case{5, 2048, 4096, 1}, Case{17, 1000, 2048, 2}, Case{32, 257, 2048, 0},
                 Case{33, 128, 64, 1}, Case{64, 130, 8, 0}, Case{3, 17000, 64, 0}, Case{64, 1024, 512, 2}}) {
    const std::vector<float> wf = normal(rng, size_t(c.N) * c.K, 1.f / std::sqrt(float(c.K)));
    std::vector<uint16_t> wb(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
    Matrix W;
    W.dtype = DType::BF16;
    W.data = wb.data();
    W.rows = c.N;
    W.cols = c.K;
    const std::vector<float> A = normal(rng, size_t(c.T) * c.K, 1.f);
    const int ldc = c.mode == 2 ? c.N / 2 : c.N;
    const std::vector<float> C0 = normal(rng, size_t(c.T) * ldc, 1.f);
    // dot[t][r] and its bound sum |a w|.
    auto dot = [&](int t, int r, double& mag) {
      double s = 0;
      mag = 0;
      for (int k = 0; k < c.K; ++k) {
        const double p = double(A[size_t(t) * c.K + k]) * double(bf16_to_f32(wb[size_t(r) * c.K + k]));
        s += p;
        mag += std::fabs(p);
      }
      return s;
    };
    const std::vector<float> got = cuda_ops::skinny_gemm(W, A, c.T, c.mode, C0);
    ASSERT_EQ(got.size(), C0.size());
    int bad = 0;
    for (int t = 0; t < c.T; ++t)
      for (int j = 0; j < ldc; ++j) {
        double want, tol;
        if (c.mode == 2) {
          double mg, mu;
          const double g = dot(t, j, mg), u = dot(t, ldc + j, mu), sg = 1.0 / (1.0 + std::exp(-g));
          want = g * sg * u;
          // |d silu(g)| <= 1.1 |dg|: the error of each factor times the other's size.
          tol = 3e-5 * (1.1 * mg * std::fabs(u) + std::fabs(g * sg) * mu) + 1e-6;
        } else {
          double m;
          want = dot(t, j, m) + (c.mode == 1 ? double(C0[size_t(t) * ldc + j]) : 0.0);
          tol = 3e-5 * m + 1e-6 * (1 + std::fabs(want));
        }
        const double e = std::fabs(double(got[size_t(t) * ldc + j]) - want);
        if (!(e <= tol) && bad++ < 5)
          ADD_FAILURE() << "T " << c.T << ", N " << c.N << ", K " << c.K << ", mode " << c.mode << ": C[" << t
                        << "][" << j << "] = " << got[size_t(t) * ldc + j] << ", want " << want << " (tol " << tol
                        << ")";
      }
    EXPECT_EQ(bad, 0) << "T " << c.T << ", N " << c.N << ", K " << c.K << ", mode " << c.mode;
    std::vector<uint16_t> chi, clo;
    const std::vector<float> split = cuda_ops::skinny_gemm_split(W, A, c.T, c.mode, C0, chi, clo);
    ASSERT_EQ(split.size(), got.size());
    int diff = 0;
    for (size_t i = 0; i < got.size(); ++i) diff += std::memcmp(&got[i], &split[i], 4) != 0;
    EXPECT_EQ(diff, 0) << "split activations: " << diff << " outputs differ from the kernel's own split, T " << c.T
                       << ", N " << c.N << ", K " << c.K << ", mode " << c.mode;
    ASSERT_EQ(chi.size(), c.mode == 2 ? got.size() : 0u);
    int split_bad = 0;
    for (size_t i = 0; i < chi.size(); ++i) {
      const uint16_t h = f32_to_bf16(split[i]), l = f32_to_bf16(split[i] - bf16_to_f32(h));
      split_bad += chi[i] != h || clo[i] != l;
    }
    EXPECT_EQ(split_bad, 0) << "swiglu's split output, T " << c.T << ", N " << c.N << ", K " << c.K;
  }
}

}  // namespace cuda_ops_test
