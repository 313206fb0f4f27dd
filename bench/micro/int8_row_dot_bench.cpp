// Thread CPU time per row of the one-token q8 / q4 dot: the fp32 AVX-512 kernel
// against the int8 AVX512-VNNI one (quantising the token included), interleaved (bench/NOTES.md).
// Build: g++ -std=c++20 -O2 -Isrc bench/micro/int8_row_dot_bench.cpp build/libflashmoe_core.a -o /tmp/int8_row_dot_bench
// Run: /tmp/int8_row_dot_bench [cols] (needs an AVX512-VNNI CPU)
#include <chrono>
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>
#include "core/matrix_rows.h"
#include "core/dtype.h"
using namespace flashmoe;
static double tcpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  const int64_t rows = 512, cols = argc > 1 ? atoi(argv[1]) : 2048, group = 64;
  for (QuantKind kind : {QuantKind::Q8, QuantKind::Q4}) {
    std::mt19937 rng(1);
    std::vector<uint8_t> data(size_t(rows * cols * quant_bits(kind) / 8));
    for (auto& b : data) b = uint8_t(rng());
    std::vector<uint16_t> s(rows * cols / group), b(rows * cols / group);
    for (auto& v : s) v = f32_to_bf16(0.01f);
    for (auto& v : b) v = f32_to_bf16(-0.5f);
    Matrix W; W.rows = rows; W.cols = cols; W.dtype = DType::U8; W.quant = kind; W.group = group;
    W.data = data.data(); W.scales = s.data(); W.biases = b.data();
    std::vector<float> x(cols), y(rows);
    for (auto& v : x) v = float(rng() % 1000) / 500 - 1;
    cpu::Int8Activations xq;
    double tf = 0, ti = 0; float sink = 0;
    for (int round = 0; round < 40; ++round) {
      double t0 = tcpu();
      for (int rep = 0; rep < 20; ++rep) for (int64_t r = 0; r < rows; ++r) y[r] = cpu::quant_dot_row_at(CpuLevel::Avx512, W, r, x.data());
      double t1 = tcpu();
      for (int rep = 0; rep < 20; ++rep) { cpu::quantize_activations(x.data(), cols, group, xq); for (int64_t r = 0; r < rows; ++r) y[r] += cpu::quant_dot_row_int8_at(CpuLevel::Avx512Vnni, W, r, xq); }
      double t2 = tcpu();
      tf += t1 - t0; ti += t2 - t1; sink += y[0];
    }
    const double n = 40.0 * 20 * rows;
    printf("%s cols %ld: fp32 avx512 %.1f ns/row, int8 vnni (incl. quantising x) %.1f ns/row, ratio %.2fx (%g)\n", quant_name(kind), long(cols), tf / n * 1e9, ti / n * 1e9, tf / ti, sink);
  }
}
