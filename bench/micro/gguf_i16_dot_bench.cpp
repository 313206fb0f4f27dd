// Thread CPU time of the one-token GGUF block products (core/block_quant_i16.h)
// at the avx2 and avx512vnni levels, on coder-mini's shapes: ns per 256
// weights, interleaved rounds (bench/NOTES.md, "GGUF decode at one thread").
// Build: g++ -std=c++20 -O2 -Isrc bench/micro/gguf_i16_dot_bench.cpp build-cpu/libflashmoe_core.a -o /tmp/gguf_i16_dot_bench
// Run: /tmp/gguf_i16_dot_bench (needs an AVX512-VNNI CPU)
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

#include "core/block_quant.h"
#include "core/block_quant_i16.h"
#include "core/dtype.h"
using namespace flashmoe;
static double tcpu() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}
int main() {
  struct Shape { QuantKind q; int64_t rows, cols; const char* what; };
  const Shape shapes[] = {{QuantKind::Q4_K, 128, 256, "expert gate/up"}, {QuantKind::Q4_K, 256, 256, "shared gate/up"},
                          {QuantKind::Q6_K, 4096, 256, "lm_head"}, {QuantKind::Q5_0, 256, 128, "expert down"},
                          {QuantKind::Q8_0, 256, 128, "expert down"}};
  for (const Shape& s : shapes) {
    std::mt19937 rng(1);
    const int64_t be = block_elems(s.q), bb = block_bytes(s.q), nb = s.rows * s.cols / be;
    // `copies` copies of the matrix spanning ~24 MB, visited out of order (a stride of
    // 7919 copies): the
    // weights come from L3 / DRAM as in a decode step, not from L1 / L2.
    const int64_t copies = std::max<int64_t>(1, (24 << 20) / (nb * bb));
    std::vector<uint8_t> data(size_t(nb * bb * copies));
    for (auto& b : data) b = uint8_t(rng());
    const uint16_t h = f32_to_f16(0.01f);
    for (int64_t k = 0; k < nb * copies; ++k) {  // sane block scales
      uint8_t* b = data.data() + k * bb;
      const int at = s.q == QuantKind::Q6_K ? 208 : 0;
      std::memcpy(b + at, &h, 2);
      if (s.q == QuantKind::Q4_K) std::memcpy(b + 2, &h, 2);
    }
    Matrix W;
    W.dtype = DType::U8;
    W.quant = s.q;
    W.data = data.data();
    W.rows = s.rows;
    W.cols = s.cols;
    std::vector<float> x(size_t(s.cols)), y(size_t(s.rows));
    for (auto& v : x) v = float(rng() % 2000) / 1000 - 1;
    cpu::Int16Activations xq;
    cpu::quantize_activations_i16(x.data(), s.cols, xq);
    const CpuLevel levels[2] = {CpuLevel::Avx2, CpuLevel::Avx512Vnni};
    double t[2] = {0, 0}, tc[2] = {0, 0};
    float sink = 0;
    const int reps = int(std::max<int64_t>(1, 4000000 / (s.rows * s.cols)));
    for (int round = 0; round < 30; ++round)
      for (int l = 0; l < 2; ++l) {
        const double t0 = tcpu();
        for (int rep = 0; rep < reps; ++rep) cpu::block_dot_rows_i16_at(levels[l], W, 0, s.rows, xq, y.data());
        t[l] += tcpu() - t0;
        sink += y[0];
        Matrix Wc = W;
        const double t1 = tcpu();
        for (int rep = 0; rep < reps; ++rep) {
          Wc.data = data.data() + size_t(((round * reps + rep) * 7919) % copies) * size_t(nb * bb);
          cpu::block_dot_rows_i16_at(levels[l], Wc, 0, s.rows, xq, y.data());
        }
        tc[l] += tcpu() - t1;
      }
    double tf = 0;
    for (int round = 0; round < 30; ++round) {
      const double t0 = tcpu();
      for (int rep = 0; rep < reps; ++rep)
        for (int64_t r = 0; r < s.rows; ++r) y[size_t(r)] = cpu::block_dot_row_at(CpuLevel::Avx512, W, r, x.data());
      tf += tcpu() - t0;
      sink += y[0];
    }
    const double n = 30.0 * reps * double(s.rows * s.cols) / 256;
    std::printf("%-5s %5ld x %3ld %-15s ns/256 weights: avx2 %.1f  avx512vnni %.1f; from L3/DRAM: %.1f  %.1f; fp32 avx512 %.1f (%g)\n",
                quant_name(s.q), long(s.rows), long(s.cols), s.what, t[0] / n * 1e9, t[1] / n * 1e9, tc[0] / n * 1e9,
                tc[1] / n * 1e9, tf / n * 1e9, double(sink));
  }
}
