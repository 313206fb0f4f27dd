#include "kv/qk_rounding.h"

#include <algorithm>
#include <cmath>

#include "kv/fp8_e4m3.h"

namespace flashmoe::fp8 {

void add_outer_product(float* H, const float* q, int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const float qi = q[i];
    float* r = H + i * d;
    for (int64_t j = 0; j < d; ++j) r[j] += qi * q[j];
  }
}

bool damped_cholesky(const float* H, int64_t d, double damp, std::vector<double>& L) {
  double tr = 0;
  for (int64_t i = 0; i < d; ++i) tr += H[i * d + i];
  if (!(tr > 0)) return false;
  const double add = damp * tr / double(d);
  L.assign(size_t(d * d), 0.0);
  for (int64_t j = 0; j < d; ++j) {
    double diag = double(H[j * d + j]) + add;
    for (int64_t k = 0; k < j; ++k) diag -= L[size_t(j * d + k)] * L[size_t(j * d + k)];
    // diag >= add > 0 in exact arithmetic; the floor guards rounding.
    const double ljj = std::sqrt(std::max(diag, add * 1e-6));
    L[size_t(j * d + j)] = ljj;
    for (int64_t i = j + 1; i < d; ++i) {
      double s = double(H[i * d + j]);
      for (int64_t k = 0; k < j; ++k) s -= L[size_t(i * d + k)] * L[size_t(j * d + k)];
      L[size_t(i * d + j)] = s / ljj;
    }
  }
  return true;
}

double qk_error(const float* x, const uint8_t* code, int64_t d, float scale, const std::vector<double>& L) {
  // |L^T e|^2, (L^T e)_i = sum_{j >= i} L_ji e_j.
  std::vector<double> e(static_cast<size_t>(d));
  for (int64_t j = 0; j < d; ++j) e[size_t(j)] = double(x[j]) - double(e4m3_decode(code[j]) * scale);
  double sum = 0;
  for (int64_t i = 0; i < d; ++i) {
    double t = 0;
    for (int64_t j = i; j < d; ++j) t += L[size_t(j * d + i)] * e[size_t(j)];
    sum += t * t;
  }
  return sum;
}

double e4m3_encode_qk(const float* x, int64_t d, float scale, const std::vector<double>& L, uint8_t* out) {
  std::vector<uint8_t> fed(static_cast<size_t>(d));
  std::vector<double> e(static_cast<size_t>(d));
  for (int64_t i = d - 1; i >= 0; --i) {
    double c = 0;  // (L^T e)_i without its own term
    for (int64_t j = i + 1; j < d; ++j) c += L[size_t(j * d + i)] * e[size_t(j)];
    const double target = double(x[i]) + c / L[size_t(i * d + i)];
    fed[size_t(i)] = e4m3_encode(float(target / double(scale)));
    e[size_t(i)] = double(x[i]) - double(e4m3_decode(fed[size_t(i)]) * scale);
  }
  e4m3_encode_scaled(x, d, scale, out);  // nearest codes
  const double err_fed = qk_error(x, fed.data(), d, scale, L), err_near = qk_error(x, out, d, scale, L);
  if (!(err_fed < err_near)) return err_near;
  for (int64_t i = 0; i < d; ++i) out[i] = fed[size_t(i)];
  return err_fed;
}

float e4m3_encode_qk_best_scale(const float* x, int64_t d, const std::vector<double>& L, uint8_t* out) {
  float mx = 0.0f;
  for (int64_t i = 0; i < d; ++i) mx = std::max(mx, std::fabs(x[i]));
  if (!(mx > 0.0f)) {
    e4m3_encode_scaled(x, d, 1.0f, out);
    return 1.0f;
  }
  std::vector<uint8_t> codes(static_cast<size_t>(d));
  float best_s = 1.0f;
  double best = INFINITY;
  for (int j = 0; j < kE4m3ScaleCandidates; ++j) {
    const float s = e4m3_scale_candidate(mx, j);
    const double e = e4m3_encode_qk(x, d, s, L, codes.data());
    if (e < best) {
      best = e;
      best_s = s;
      std::copy(codes.begin(), codes.end(), out);
    }
  }
  return best_s;
}

}  // namespace flashmoe::fp8
