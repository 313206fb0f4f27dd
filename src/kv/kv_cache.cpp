#include "kv/kv_cache.h"

#include <algorithm>
#include <cmath>

#include "backend/cpu/simd.h"

namespace flashmoe {

KvCache::KvCache(int64_t num_kv_heads, int64_t head_dim, const KvConfig& cfg)
    : nkv_(num_kv_heads), hd_(head_dim), cfg_(cfg) {
  cfg_.validate();
}

void KvCache::clear() {
  k_.clear();
  v_.clear();
  pos_.clear();
}

size_t KvCache::bytes() const { return (k_.capacity() + v_.capacity()) * sizeof(float); }

void KvCache::append(int64_t pos, const float* k, const float* v) {
  const int64_t row = nkv_ * hd_;
  k_.insert(k_.end(), k, k + row);
  v_.insert(v_.end(), v, v + row);
  pos_.push_back(pos);
}

void KvCache::attend(const float* q, int64_t num_heads, float scale, float* out) {
  const int64_t n = size(), row = nkv_ * hd_, group = num_heads / nkv_;
  scores_.resize(size_t(n));
  for (int64_t h = 0; h < num_heads; ++h) {
    const int64_t kvh = h / group;
    const float* qh = q + h * hd_;
    float mx = -INFINITY;
    for (int64_t s = 0; s < n; ++s) {
      scores_[s] = cpu::simd::dot_f32(qh, k_.data() + s * row + kvh * hd_, hd_) * scale;
      mx = std::max(mx, scores_[s]);
    }
    float sum = 0;
    for (int64_t s = 0; s < n; ++s) sum += (scores_[s] = std::exp(scores_[s] - mx));
    float* oh = out + h * hd_;
    std::fill(oh, oh + hd_, 0.0f);
    for (int64_t s = 0; s < n; ++s) cpu::simd::axpy(scores_[s] / sum, v_.data() + s * row + kvh * hd_, oh, hd_);
  }
}

}  // namespace flashmoe
