// GGUF weights on the CUDA backend: the block kernels (decode matvec, the
// batched prefill's product) against the CPU's block kernels on random
// blocks of every kind, and GGUF models' logits on the GPU against the CPU
// backend on the same file (the prompt through the batched prefill, then
// token by token through the decode step, then greedy ids on the device).
// Skipped where no GPU is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "backend/cuda/op_check.h"
#include "core/argmax.h"
#include "core/block_quant.h"
#include "core/dtype.h"
#include "engine/session.h"
#include "test_util.h"

namespace cuda_gguf_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

std::vector<float> normal(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.f, 1.f);
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

class CudaGgufOps : public ::testing::TestWithParam<QuantKind> {};

TEST_P(CudaGgufOps, MatvecAndProductMatchCpu) {
  REQUIRE_GPU();
  const QuantKind q = GetParam();
  std::mt19937 rng(99 + int(q));
  const int64_t rows = 70, cols = 1024;  // 4 blocks of 256 a row (Q4_K: a quarter-warp a block); rows not a multiple of a warp's
  const std::vector<uint8_t> data = random_quant_blocks(q, rows, cols, rng);
  const Matrix W = quant_matrix(q, data, rows, cols);
  const std::vector<float> x = normal(rng, size_t(cols));
  std::vector<float> want(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) want[size_t(r)] = cpu::block_dot_row(W, r, x.data());
  for (bool staged : {true, false})
    EXPECT_LE(rel_err(cuda_ops::gguf_matvec(W, x, staged), want), 1e-5f) << quant_name(q) << " staged " << staged;
  const int T = 37;
  const std::vector<float> A = normal(rng, size_t(T) * cols);
  std::vector<float> wantC(size_t(T) * rows);
  for (int t = 0; t < T; ++t)
    for (int64_t r = 0; r < rows; ++r)
      wantC[size_t(t) * rows + size_t(r)] = cpu::block_dot_row(W, r, A.data() + size_t(t) * cols);
  for (int bm : {16, 32, 64})
    EXPECT_LE(rel_err(cuda_ops::gguf_gemm(W, A, T, bm), wantC), 1e-4f) << quant_name(q) << " bm " << bm;
}

// Dense matrices repacked as the upload repacks the decode step's
// projections and lm_head (gguf_dense_layout.cuh), through the decode
// matvec (gdense_matvec_kernel) and the prefill's product: against the
// CPU's block kernels and against the file blocks' kernels. 1280 columns:
// the last tile of 32 groups only partly filled.
TEST_P(CudaGgufOps, RepackedMatvecAndProductMatchCpu) {
  REQUIRE_GPU();
  const QuantKind q = GetParam();
  if (q == QuantKind::IQ4_NL || q == QuantKind::IQ4_XS) GTEST_SKIP() << "no repacked form (the file's blocks stay)";
  std::mt19937 rng(199 + int(q));
  for (const int64_t cols : {int64_t(1024), int64_t(1280)}) {
    const int64_t rows = 70;
    const std::vector<uint8_t> data = random_quant_blocks(q, rows, cols, rng);
    const Matrix W = quant_matrix(q, data, rows, cols);
    const std::vector<float> x = normal(rng, size_t(cols));
    std::vector<float> want(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) want[size_t(r)] = cpu::block_dot_row(W, r, x.data());
    const std::vector<float> got = cuda_ops::gguf_dense_matvec({W}, x, {}, 0.f, {});
    EXPECT_LE(rel_err(got, want), 1e-5f) << quant_name(q) << " cols " << cols;
    EXPECT_LE(rel_err(got, cuda_ops::gguf_matvec(W, x, true)), 1e-5f) << quant_name(q) << " cols " << cols;
    const int T = 21;
    const std::vector<float> A = normal(rng, size_t(T) * cols);
    // The same weights read from either layout: the same products.
    EXPECT_LE(rel_err(cuda_ops::gguf_gemm(W, A, T, 32, true), cuda_ops::gguf_gemm(W, A, T, 32, false)), 1e-6f)
        << quant_name(q) << " cols " << cols;
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, CudaGgufOps,
                         ::testing::Values(QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q5_0,
                                           QuantKind::Q5_1, QuantKind::IQ4_NL, QuantKind::Q4_K, QuantKind::Q5_K,
                                           QuantKind::Q6_K, QuantKind::IQ4_XS),
                         [](const auto& info) { return std::string(quant_name(info.param)); });

// The parts of an attention layer's q/k/v projection of a Q4_K_M file
// (Q4_K, Q4_K, Q6_K) and an out-projection's shape (few rows of 4096
// columns: several warps share a row group), repacked, the input norm fused
// and the product added onto y0, against the CPU.
TEST(CudaGgufDense, MixedPartsNormAndSplitMatchCpu) {
  REQUIRE_GPU();
  const float eps = 1e-6f;
  struct Case {
    std::vector<QuantKind> kinds;
    std::vector<int> rows;
    int cols;
  };
  for (const Case& cs : {Case{{QuantKind::Q4_K, QuantKind::Q4_K, QuantKind::Q6_K}, {64, 16, 17}, 2048},
                         Case{{QuantKind::Q4_K}, {24}, 4096}, Case{{QuantKind::Q8_0, QuantKind::Q5_K}, {9, 40}, 4096}}) {
    std::mt19937 rng(5 + cs.cols + int(cs.kinds.size()));
    std::vector<std::vector<uint8_t>> store(cs.kinds.size());
    std::vector<Matrix> parts;
    for (size_t i = 0; i < cs.kinds.size(); ++i) {
      store[i] = random_quant_blocks(cs.kinds[i], cs.rows[i], cs.cols, rng);
      Matrix m;
      m.dtype = DType::U8;
      m.quant = cs.kinds[i];
      m.data = store[i].data();
      m.rows = cs.rows[i];
      m.cols = cs.cols;
      parts.push_back(m);
    }
    const std::vector<float> x = normal(rng, size_t(cs.cols)), nw = normal(rng, size_t(cs.cols));
    float ss = 0.f;
    for (float v : x) ss += v * v;
    const float r = 1.0f / std::sqrt(ss / float(cs.cols) + eps);
    std::vector<float> xn(size_t(cs.cols));
    for (int i = 0; i < cs.cols; ++i) xn[size_t(i)] = x[size_t(i)] * r * (1.0f + nw[size_t(i)]);
    std::vector<float> y0, want;
    for (const Matrix& m : parts)
      for (int64_t row = 0; row < m.rows; ++row) {
        y0.push_back(float(int(y0.size()) % 7) - 3.f);
        want.push_back(y0.back() + cpu::block_dot_row(m, row, xn.data()));
      }
    EXPECT_LE(rel_err(cuda_ops::gguf_dense_matvec(parts, x, nw, eps, y0), want), 1e-5f)
        << quant_name(cs.kinds[0]) << " cols " << cs.cols;
  }
}

// A MoE layer's routed experts in GGUF blocks through the decode step's
// staged kernels and (Q4_K / Q6_K) the chunk-layout kernels (the pick made
// inside gate_up from the router's logits) against the CPU: softmax top-k
// renormalised, then the block kernels' row products. Kind mixes: the 35B Q4_K_M file's (gate/up Q4_K, down Q6_K or
// Q4_K) and Q8_0 (coder-mini's).
TEST(CudaGgufExperts, KernelsMatchCpu) {
  REQUIRE_GPU();
  const float eps = 1e-6f;
  struct Mix {
    QuantKind gu, dn;
    int H, I, E, k;
    int Is = 0;  // a shared expert of Is rows (gate/up in gu's kind, down in dn's), chunk kernels only
  };
  // Gate/up rows of 4 Q4_K blocks (the staged kernels: a quarter-warp a
  // block), and the 35B's shape (H 2048, I 512, top-8) for the chunk
  // kernels, with its shared expert; 10 of 40 experts of 1,024 Q6_K rows
  // (more row pairs than one wave of warps takes at once); H 4096: a gate/up
  // row pair is more chunks than the lanes have in flight at once.
  for (const Mix mix : {Mix{QuantKind::Q4_K, QuantKind::Q6_K, 1024, 256, 6, 3},
                        Mix{QuantKind::Q4_K, QuantKind::Q6_K, 4096, 256, 6, 3},
                        Mix{QuantKind::Q4_K, QuantKind::Q4_K, 1024, 256, 6, 3},
                        Mix{QuantKind::Q8_0, QuantKind::Q8_0, 1024, 256, 6, 3},
                        Mix{QuantKind::Q4_K, QuantKind::Q6_K, 2048, 512, 12, 8},
                        Mix{QuantKind::Q4_K, QuantKind::Q4_K, 2048, 512, 12, 8},
                        Mix{QuantKind::Q4_K, QuantKind::Q6_K, 2048, 512, 12, 8, 512},
                        Mix{QuantKind::Q6_K, QuantKind::Q4_K, 1024, 1024, 40, 10, 256}}) {
    const int H = mix.H, I = mix.I, E = mix.E, k = mix.k;
    std::mt19937 rng(7 + int(mix.gu) + 31 * int(mix.dn) + H);
    std::vector<std::vector<uint8_t>> store;
    auto mat = [&](QuantKind q, int rows, int cols) {
      store.push_back(random_quant_blocks(q, rows, cols, rng));
      Matrix m;
      m.dtype = DType::U8;
      m.quant = q;
      m.data = store.back().data();
      m.rows = rows;
      m.cols = cols;
      return m;
    };
    store.reserve(size_t(3 * E));
    std::vector<cuda_ops::GgufExpert> experts;
    for (int e = 0; e < E; ++e) experts.push_back({mat(mix.gu, I, H), mat(mix.gu, I, H), mat(mix.dn, H, I)});
    cuda_ops::GgufExpert shared_expert;
    if (mix.Is) shared_expert = {mat(mix.gu, mix.Is, H), mat(mix.gu, mix.Is, H), mat(mix.dn, H, mix.Is)};
    const std::vector<float> x = normal(rng, H), nw = normal(rng, H), logits = normal(rng, E + (mix.Is ? 1 : 0));
    // The CPU's pick: softmax, the k largest, renormalised.
    std::vector<int> order(E);
    for (int e = 0; e < E; ++e) order[size_t(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int p, int q) { return logits[size_t(p)] > logits[size_t(q)]; });
    float chosen = 0.f;
    for (int j = 0; j < k; ++j) chosen += std::exp(logits[size_t(order[size_t(j)])]);
    float ss = 0.f;
    for (float v : x) ss += v * v;
    const float r = 1.0f / std::sqrt(ss / float(H) + eps);
    std::vector<float> xn(H), want = x;
    for (int i = 0; i < H; ++i) xn[size_t(i)] = x[size_t(i)] * r * (1.0f + nw[size_t(i)]);
    // want += weight * down(silu(gate xn) * (up xn)) of an expert of `rows` rows.
    auto add_expert = [&](const cuda_ops::GgufExpert& ex, int rows, float weight) {
      std::vector<float> h(rows);
      for (int i = 0; i < rows; ++i) {
        const float g = cpu::block_dot_row(ex.gate, i, xn.data()), u = cpu::block_dot_row(ex.up, i, xn.data());
        h[size_t(i)] = g / (1.0f + std::exp(-g)) * u;
      }
      for (int o = 0; o < H; ++o) want[size_t(o)] += weight * cpu::block_dot_row(ex.down, o, h.data());
    };
    for (int j = 0; j < k; ++j)
      add_expert(experts[size_t(order[size_t(j)])], I, std::exp(logits[size_t(order[size_t(j)])]) / chosen);
    const float ws = mix.Is ? 1.0f / (1.0f + std::exp(-logits[size_t(E)])) : 0.f;  // the shared expert's gate
    if (mix.Is) add_expert(shared_expert, mix.Is, ws);
    // The staged kernels on the stored blocks, then (Q4_K / Q6_K) the chunk
    // kernels on the blocks rearranged as upload.cu does: each against the
    // CPU, and the two against each other (the same weights: they differ by
    // fp32 summation order only).
    // A shared expert of the routed experts' shape goes both ways: its
    // stored rows, and (as upload.cu copies it) in their chunk layout.
    std::vector<float> staged_dx;
    for (const int variant : {0, 1, 2}) {
      const bool chunks = variant > 0, shared_chunks = variant == 2;
      if (chunks && mix.gu == QuantKind::Q8_0) continue;  // no chunk layout
      if (!chunks && mix.Is) continue;                    // the op check takes a shared expert on the chunk kernels
      if (shared_chunks && mix.Is != I) continue;
      std::vector<int> ids;
      std::vector<float> w;
      const std::vector<float> got = cuda_ops::gguf_experts(experts, logits, k, x, nw, eps, &ids, &w, chunks,
                                                            mix.Is ? &shared_expert : nullptr, shared_chunks);
      const std::string what = std::string(quant_name(mix.gu)) + "/" + quant_name(mix.dn) + " H " + std::to_string(H) +
                               " I " + std::to_string(I) + (mix.Is ? " + shared" : "") +
                               (shared_chunks ? " in chunks" : "") + (chunks ? " chunks" : "");
      EXPECT_EQ(ids, std::vector<int>(order.begin(), order.begin() + k)) << what;
      for (int j = 0; j < k; ++j)
        EXPECT_NEAR(w[size_t(j)], std::exp(logits[size_t(order[size_t(j)])]) / chosen, 1e-6f) << what;
      if (mix.Is) {
        EXPECT_NEAR(w.at(size_t(k)), ws, 1e-6f) << what;
      }
      std::vector<float> dx(H), dwant(H);
      for (int i = 0; i < H; ++i)
        dx[size_t(i)] = got[size_t(i)] - x[size_t(i)], dwant[size_t(i)] = want[size_t(i)] - x[size_t(i)];
      EXPECT_LE(rel_err(dx, dwant), 1e-5f) << what;
      if (chunks && mix.Is) {
        std::printf("[cuda-gguf] experts %s: rel err vs CPU %.3g\n", what.c_str(), rel_err(dx, dwant));
      } else if (chunks) {
        EXPECT_LE(rel_err(dx, staged_dx), 1e-5f) << what << " vs staged";
        std::printf("[cuda-gguf] experts %s: rel err vs CPU %.3g, vs the staged kernels %.3g\n", what.c_str(),
                    rel_err(dx, dwant), rel_err(dx, staged_dx));
      } else {
        staged_dx = dx;
      }
    }
  }
}

class CudaGgufModel : public ::testing::TestWithParam<const char*> {};

// The tiny GGUF fixtures (Q8_0, Q4_K_M mixes with Q5_0 / Q8_0 / Q4_K, BF16;
// qwen35 dense with tiled value heads, qwen35moe, qwen3next) on the GPU
// against the CPU on the same file: fp32 math on both, so the logits agree
// to rounding.
TEST_P(CudaGgufModel, LogitsMatchCpu) {
  REQUIRE_GPU();
  const std::string name = GetParam();
  const std::string file = source_path("tests/fixtures/gguf/" + name + ".gguf");
  auto model = QwenModel::load(file);
  auto cuda = CudaModel::upload(*model);
  const int64_t V = model->config().vocab_size;
  // The reference ids (the quantised files' 64 are in their -deq-f32 logits file).
  const bool deq = name.find("bf16") == std::string::npos;
  RefTensor ref = load_ref(file + (deq ? ".llama-logits-deq-f32.safetensors" : ".llama-logits.safetensors"), "ids");
  ASSERT_GE(ref.ids.size(), 16u) << name;
  std::vector<int32_t> ids(ref.ids.begin(), ref.ids.begin() + std::min<size_t>(48, ref.ids.size()));
  ThreadPool pool(2);
  {
    Session cpu(cpu_of(*model), KvConfig{}, pool), gpu(gpu_view(*model, *cuda), KvConfig{}, pool);
    const std::vector<float> a = cpu.feed_all(ids), b = gpu.feed_all(ids);
    ASSERT_EQ(a.size(), b.size());
    const float d = max_abs_diff(a.data(), b.data(), a.size());
    EXPECT_LE(d, 1e-3f) << name << ": prefill";
    std::printf("[cuda-gguf] %s prefill: max |dlogit| %.3g, mean KL %.3g\n", name.c_str(), d, mean_kl(a, b, V));
  }
  {
    // Token by token: the decode step's kernels.
    Session cpu(cpu_of(*model), KvConfig{}, pool), gpu(gpu_view(*model, *cuda), KvConfig{}, pool);
    float worst = 0.f;
    for (size_t i = 0; i < 12; ++i) {
      const std::vector<float> a = cpu.feed({ids[i]}), b = gpu.feed({ids[i]});
      ASSERT_EQ(a.size(), b.size());
      worst = std::max(worst, max_abs_diff(a.data(), b.data(), a.size()));
    }
    EXPECT_LE(worst, 1e-3f) << name << ": decode";
    std::printf("[cuda-gguf] %s decode: max |dlogit| %.3g\n", name.c_str(), worst);
  }
  {
    // Greedy ids on the device (embedding rows and argmax in the step).
    Session cpu(cpu_of(*model), KvConfig{}, pool), gpu(gpu_view(*model, *cuda), KvConfig{}, pool);
    const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 8);
    const std::vector<float>* l = &cpu.feed(prompt);
    std::vector<int32_t> want;
    for (int i = 0; i < 8; ++i) {
      want.push_back(int32_t(argmax(l->data(), V)));
      l = &cpu.feed({want.back()});
    }
    gpu.feed(prompt);
    EXPECT_EQ(gpu.greedy(8), want) << name;
  }
}

// The decode step with the dense matrices repacked (the default) against
// the same file's blocks read by the staged kernels: the same weights, so
// the logits agree to fp32 summation order.
TEST_P(CudaGgufModel, RepackedMatchesFileBlocks) {
  REQUIRE_GPU();
  const std::string name = GetParam();
  if (name.find("bf16") != std::string::npos) GTEST_SKIP() << "no GGUF blocks to repack";
  const std::string file = source_path("tests/fixtures/gguf/" + name + ".gguf");
  auto model = QwenModel::load(file);
  CudaOptions blocks;
  blocks.decode.gguf_dense_repack = false;
  auto packed = CudaModel::upload(*model), plain = CudaModel::upload(*model, blocks);
  const int64_t V = model->config().vocab_size;
  RefTensor ref = load_ref(file + ".llama-logits-deq-f32.safetensors", "ids");
  ThreadPool pool(2);
  Session a(gpu_view(*model, *packed), KvConfig{}, pool), b(gpu_view(*model, *plain), KvConfig{}, pool);
  float worst = 0.f, kl = 0.f;
  for (size_t i = 0; i < 12 && i < ref.ids.size(); ++i) {
    const std::vector<float> la = a.feed({int32_t(ref.ids[i])}), lb = b.feed({int32_t(ref.ids[i])});
    worst = std::max(worst, max_abs_diff(la.data(), lb.data(), la.size()));
    kl = std::max(kl, float(mean_kl(lb, la, V)));
  }
  EXPECT_LE(worst, 1e-4f) << name;
  EXPECT_LE(kl, 1e-6f) << name;
  std::printf("[cuda-gguf] %s repacked vs file blocks (decode): max |dlogit| %.3g, KL %.3g\n", name.c_str(), worst, kl);
}

// A GGUF whose routed experts take the chunk kernels (Q4_K / Q6_K, widths
// of whole blocks: none of the tiny fixtures) named by FLASHMOE_GGUF_CHUNKS,
// e.g. `python3 bench/gguf_random_35b.py TEMPLATE.gguf small.gguf --layers 4
// --experts 32` (the 35B's kinds and widths, its shared expert stored as
// the routed experts are, so it is read in their chunk layout too): the
// decode step token by token against the CPU, and against the same GPU
// reading the experts as stored (--gguf-experts stored). Skipped without it
// (the file is too large for tests/fixtures).
TEST(CudaGgufChunks, DecodeMatchesCpuAndStored) {
  REQUIRE_GPU();
  const char* file = std::getenv("FLASHMOE_GGUF_CHUNKS");
  if (!file) GTEST_SKIP() << "FLASHMOE_GGUF_CHUNKS names no GGUF file";
  auto model = QwenModel::load(file);
  CudaOptions stored;
  stored.decode.gguf_expert_chunks = false;
  auto chunks = CudaModel::upload(*model), plain = CudaModel::upload(*model, stored);
  const int64_t V = model->config().vocab_size;
  ThreadPool pool(8);
  Session cpu(cpu_of(*model), KvConfig{}, pool), a(gpu_view(*model, *chunks), KvConfig{}, pool),
      b(gpu_view(*model, *plain), KvConfig{}, pool);
  float worst_cpu = 0.f, worst_stored = 0.f, scale = 0.f;
  std::mt19937 rng(3);
  for (int i = 0; i < 12; ++i) {
    const int32_t id = int32_t(rng() % uint32_t(std::min<int64_t>(V, 100000)));
    const std::vector<float> lc = cpu.feed({id}), la = a.feed({id}), lb = b.feed({id});
    ASSERT_EQ(la.size(), lc.size());
    for (float v : lc) scale = std::max(scale, std::fabs(v));
    worst_cpu = std::max(worst_cpu, max_abs_diff(la.data(), lc.data(), la.size()));
    worst_stored = std::max(worst_stored, max_abs_diff(la.data(), lb.data(), la.size()));
  }
  // fp32 math on all three: they differ by summation order only.
  EXPECT_LE(worst_cpu, 1e-3f + 1e-4f * scale);
  EXPECT_LE(worst_stored, 1e-3f + 1e-4f * scale);
  std::printf("[cuda-gguf] %s chunk experts (decode): max |dlogit| vs CPU %.3g, vs stored %.3g, max |logit| %.3g\n",
              file, worst_cpu, worst_stored, scale);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaGgufModel,
                         ::testing::Values("tiny-qwen35-dense-q8_0", "tiny-qwen35-dense-bf16",
                                           "tiny-qwen35moe-text-q4_k_m", "tiny-qwen3next-q4_k_m"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace

}  // namespace cuda_gguf_test
