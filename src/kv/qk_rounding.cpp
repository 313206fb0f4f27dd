#include "kv/qk_rounding.h"

#include <algorithm>
#include <cmath>

#include "core/simd.h"
#include "kv/fp8_e4m3.h"

namespace flashmoe::fp8 {

void add_outer_product(float* Hp, const float* q, int64_t d) {
  // Row i of the triangle, (i, 0..i), is contiguous: one axpy per row.
  for (int64_t i = 0; i < d; ++i) cpu::simd::axpy(q[i], q, Hp + packed_triangle(i), i + 1);
}

bool damped_cholesky(const float* Hp, int64_t d, double damp, std::vector<float>& L) {
  double tr = 0;
  for (int64_t i = 0; i < d; ++i) tr += Hp[packed_triangle(i) + i];
  if (!(tr > 0)) return false;
  const double add = damp * tr / double(d);
  // Factored in double (H sums thousands of outer products; its small
  // eigenvalues are what the damping is for), stored in float for the walk.
  std::vector<double> Ld(static_cast<size_t>(d * d), 0.0);
  for (int64_t j = 0; j < d; ++j) {
    double diag = double(Hp[packed_triangle(j) + j]) + add;
    const double* lj = Ld.data() + j * d;
    for (int64_t k = 0; k < j; ++k) diag -= lj[k] * lj[k];
    // diag >= add > 0 in exact arithmetic; the floor guards rounding.
    const double ljj = std::sqrt(std::max(diag, add * 1e-6));
    Ld[size_t(j * d + j)] = ljj;
    for (int64_t i = j + 1; i < d; ++i) {
      double s = double(Hp[packed_triangle(i) + j]);
      const double* li = Ld.data() + i * d;
      for (int64_t k = 0; k < j; ++k) s -= li[k] * lj[k];
      Ld[size_t(i * d + j)] = s / ljj;
    }
  }
  L.resize(size_t(d * d));
  for (size_t i = 0; i < Ld.size(); ++i) L[i] = float(Ld[i]);
  return true;
}

namespace {

// Working rows of one walk (per thread: keys of a chunk round in parallel).
struct Walk {
  std::vector<float> c, e;
  std::vector<uint8_t> codes, fed;
  void size(int64_t d) {
    if (int64_t(c.size()) < d) {
      c.resize(size_t(d));
      e.resize(size_t(d));
      codes.resize(size_t(d));
      fed.resize(size_t(d));
    }
  }
};
thread_local Walk t_walk;

// |L^T e|^2 with t = L^T e accumulated row by row of L, i = d-1 .. 0:
// t[0..i) += L_i[0..i) e_i (contiguous), then t_i = (the sum so far) +
// L_ii e_i. fed: round element i from x_i + t_i / L_ii before its own term
// (the error feedback); otherwise code[] is given.
double walk(const float* x, int64_t d, float scale, const float* L, uint8_t* code, bool fed, float* t) {
  std::fill(t, t + d, 0.0f);
  double sum = 0;
  for (int64_t i = d - 1; i >= 0; --i) {
    const float* li = L + i * d;
    if (fed) code[i] = e4m3_encode(float((double(x[i]) + double(t[i]) / double(li[i])) / double(scale)));
    const float ei = x[i] - e4m3_decode(code[i]) * scale;
    const float ti = t[i] + li[i] * ei;
    sum += double(ti) * double(ti);
    cpu::simd::axpy(ei, li, t, i);
  }
  return sum;
}

}  // namespace

double qk_error(const float* x, const uint8_t* code, int64_t d, float scale, const float* L) {
  Walk& w = t_walk;
  w.size(d);
  std::copy(code, code + d, w.codes.begin());
  return walk(x, d, scale, L, w.codes.data(), false, w.c.data());
}

double e4m3_encode_qk(const float* x, int64_t d, float scale, const float* L, uint8_t* out) {
  Walk& w = t_walk;
  w.size(d);
  const double err_fed = walk(x, d, scale, L, w.fed.data(), true, w.c.data());
  e4m3_encode_scaled(x, d, scale, out);  // nearest codes
  const double err_near = walk(x, d, scale, L, out, false, w.c.data());
  if (!(err_fed < err_near)) return err_near;
  std::copy(w.fed.begin(), w.fed.begin() + d, out);
  return err_fed;
}

float e4m3_encode_qk_best_scale(const float* x, int64_t d, const float* L, uint8_t* out) {
  float mx = 0.0f;
  for (int64_t i = 0; i < d; ++i) mx = std::max(mx, std::fabs(x[i]));
  if (!(mx > 0.0f)) {
    e4m3_encode_scaled(x, d, 1.0f, out);
    return 1.0f;
  }
  thread_local std::vector<uint8_t> codes;
  codes.resize(size_t(d));
  float best_s = 1.0f;
  double best = INFINITY;
  for (int j = 0; j < kE4m3ScaleCandidates; ++j) {
    const float s = e4m3_scale_candidate_f24(mx, j);
    const double e = e4m3_encode_qk(x, d, s, L, codes.data());
    if (e < best) {
      best = e;
      best_s = s;
      std::copy(codes.begin(), codes.begin() + d, out);
    }
  }
  return best_s;
}

}  // namespace flashmoe::fp8
