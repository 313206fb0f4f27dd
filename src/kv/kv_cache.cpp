#include "kv/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/dtype.h"
#include "core/error.h"
#include "core/simd.h"
#include "core/thread_pool.h"
#include "kv/fp8_e4m3.h"
#include "kv/kv_kernels.h"
#include "kv/qk_rounding.h"
#include "kv/snapkv_select.h"

namespace flashmoe {

namespace {
// fp8 `channel` keys: H + kQkDamping x (trace(H) / d) I. The queries seen so
// far stand in for the ones still to come; a smaller damping trusts them
// more. Measured on coder-mini (bench/NOTES.md): 1 of {0.3, 1, 3} best.
constexpr double kQkDamping = 1.0;
}  // namespace

KvCache::KvCache(int64_t num_kv_heads, int64_t head_dim, const KvConfig& cfg)
    : nkv_(num_kv_heads), hd_(head_dim), row_(num_kv_heads * head_dim), cfg_(cfg) {
  if (nkv_ <= 0 || hd_ <= 0) fail("KvCache: num_kv_heads and head_dim must be positive");
  cfg_.validate();
  ret_ = cfg_.retention();
  el_ = kv_elem_size(cfg_.dtype);
  ns_ = cfg_.dtype != KvDType::FP8 ? 0 : cfg_.fp8_scale == Fp8ScaleMode::Position ? 1 : nkv_;
  const bool fp8 = cfg_.dtype == KvDType::FP8;
  const Fp8ScaleMode m = cfg_.fp8_scale;
  channel_ = fp8 && m == Fp8ScaleMode::Channel;
  rotated_ = fp8 && (m == Fp8ScaleMode::Rotated || channel_);
  if (rotated_ && (hd_ & (hd_ - 1)) != 0)
    fail(std::string("--kv-fp8-scale ") + fp8_scale_mode_name(m) + " needs a power-of-two head_dim (this model's is " +
         std::to_string(hd_) + ")");
  cap_ = cfg_.capacity();
  if (cap_ > 0 && ret_ != KvRetention::SnapKV) {  // snapkv grows during the prompt
    // Allocated once, with the element size of this config; never grows.
    k_.assign(size_t(cap_ * row_) * el_, 0);
    v_.assign(size_t(cap_ * row_) * el_, 0);
    ks_.assign(size_t(cap_ * ns_), 0.0f);
    vs_.assign(size_t(cap_ * ns_), 0.0f);
    pos_.assign(size_t(cap_), -1);
    if (cfg_.scored_eviction()) acc_.assign(size_t(cap_), 0.0f);
  }
}

void KvCache::truncate(int64_t n) {
  if (!truncatable()) fail("KvCache::truncate: only a full cache (not fp8 channel) takes positions back");
  if (n < 0 || n > n_) fail("KvCache::truncate: " + std::to_string(n) + " of " + std::to_string(n_) + " positions");
  n_ = appended_ = n;
  last_pos_ = n > 0 ? pos_[size_t(n - 1)] : -1;
}

void KvCache::clear() {
  n_ = 0;
  appended_ = 0;
  last_pos_ = -1;
  compressed_ = false;
  obs_n_ = 0;
  obs_last_slot_ = -1;
  ring_ = 0;
  if (cap_ == 0 || ret_ == KvRetention::SnapKV) {  // full, quest, snapkv: give the memory back
    k_.clear(); k_.shrink_to_fit();
    v_.clear(); v_.shrink_to_fit();
    ks_.clear(); ks_.shrink_to_fit();
    vs_.clear(); vs_.shrink_to_fit();
    pos_.clear(); pos_.shrink_to_fit();
    scratch_.probs.clear(); scratch_.probs.shrink_to_fit();
    kmin_.clear(); kmin_.shrink_to_fit();
    kmax_.clear(); kmax_.shrink_to_fit();
    kz_.clear(); kz_.shrink_to_fit();
    kacc_.clear(); kacc_.shrink_to_fit();
    ks24_.clear(); ks24_.shrink_to_fit();
    vs16_.clear(); vs16_.shrink_to_fit();
    qmom_.clear(); qmom_.shrink_to_fit();
    drop_query_factors();
    sel_.clear();
    sel_all_ = true;
  } else if (!acc_.empty()) {
    std::fill(acc_.begin(), acc_.end(), 0.0f);
  }
}

size_t KvCache::bytes() const {
  return k_.capacity() + v_.capacity() +
         (ks_.capacity() + vs_.capacity() + acc_.capacity() + kmin_.capacity() + kmax_.capacity() + kz_.capacity() +
          kacc_.capacity() + qmom_.capacity()) * sizeof(float) +
         ks24_.capacity() + vs16_.capacity() * sizeof(uint16_t) + pos_.capacity() * sizeof(int64_t) +
         qchol_.size() * size_t(hd_ * hd_) * sizeof(float);
}

void KvCache::drop_query_factors() {
  qchol_.clear();
  qchol_.shrink_to_fit();
  qchol_valid_ = false;
}

void KvCache::ensure_slots(int64_t slots) {
  if (int64_t(pos_.size()) >= slots) return;
  k_.resize(size_t(slots * row_) * el_);
  v_.resize(size_t(slots * row_) * el_);
  if (channel_) {
    ks24_.resize(size_t(slots * ns_) * 3);
    vs16_.resize(size_t(slots * ns_));
  } else {
    ks_.resize(size_t(slots * ns_));
    vs_.resize(size_t(slots * ns_));
  }
  pos_.resize(size_t(slots), -1);
}

std::vector<int64_t> KvCache::positions() const {
  std::vector<int64_t> p(pos_.begin(), pos_.begin() + n_);
  std::sort(p.begin(), p.end());
  return p;
}

// ---------------------------------------------------------------- storage

template <KvDType T>
void KvCache::store(int64_t slot, const float* k, const float* v) {
  const size_t off = size_t(slot * row_);
  if constexpr (T == KvDType::F32) {
    std::memcpy(k_.data() + off * 4, k, size_t(row_) * 4);
    std::memcpy(v_.data() + off * 4, v, size_t(row_) * 4);
  } else if constexpr (T == KvDType::BF16 || T == KvDType::F16) {
    uint16_t* kd = reinterpret_cast<uint16_t*>(k_.data()) + off;
    uint16_t* vd = reinterpret_cast<uint16_t*>(v_.data()) + off;
    for (int64_t i = 0; i < row_; ++i) {
      if constexpr (T == KvDType::BF16) {
        kd[i] = f32_to_bf16(k[i]);
        vd[i] = f32_to_bf16(v[i]);
      } else {
        kd[i] = f32_to_f16(k[i]);
        vd[i] = f32_to_f16(v[i]);
      }
    }
  } else {
    if (rotated_) {  // H k, H v per head, then quantised as `head` (channel: keys offset first)
      rot_.assign(k, k + row_);
      rot_.insert(rot_.end(), v, v + row_);
      for (int64_t b = 0; b < 2 * nkv_; ++b) kv_kernels::hadamard_ortho(rot_.data() + b * hd_, hd_);
      k = rot_.data();
      v = rot_.data() + row_;
    }
    if (channel_) {
      store_channel(slot, k, v);
      return;
    }
    const int64_t block = row_ / ns_;  // whole row (position) or one head
    for (int64_t b = 0; b < ns_; ++b) {
      const float* kb = k + b * block;
      const float* vb = v + b * block;
      const float sk = fp8::e4m3_block_scale(kb, block);
      ks_[size_t(slot * ns_ + b)] = sk;
      fp8::e4m3_encode_scaled(kb, block, sk, k_.data() + off + size_t(b * block));
      const float sv = fp8::e4m3_block_scale(vb, block);
      vs_[size_t(slot * ns_ + b)] = sv;
      fp8::e4m3_encode_scaled(vb, block, sv, v_.data() + off + size_t(b * block));
    }
  }
}

void KvCache::store_channel(int64_t slot, const float* k, const float* v) {
  // k, v: rotated rows.
  channel_factor();
  ctr_.resize(size_t(row_));
  channel_center(slot, k, ctr_.data());
  for (int64_t h = 0; h < nkv_; ++h) channel_encode(slot, h, ctr_.data(), v);
}

void KvCache::channel_factor() {
  if (qchol_valid_ || qmom_.empty()) return;  // current, or no query yet
  qchol_.resize(size_t(nkv_));
  for (int64_t h = 0; h < nkv_; ++h)
    if (!fp8::damped_cholesky(qmom_.data() + h * fp8::packed_triangle(hd_), hd_, kQkDamping, qchol_[size_t(h)]))
      qchol_[size_t(h)].clear();
  qchol_valid_ = true;
}

void KvCache::channel_center(int64_t slot, const float* k, float* ctr) {
  // Minus the page's offsets, the mean of the previous page's rotated
  // keys (0 for page 0): the channels a key keeps nearly constant leave
  // only their variation to E4M3's relative precision. Slots in order: the
  // page sums are running.
  const int64_t P = kFp8OffsetPage, page = slot / P;
  if (slot % P == 0) {
    kz_.resize(size_t((page + 1) * row_), 0.0f);
    if (page > 0)
      for (int64_t i = 0; i < row_; ++i) kz_[size_t(page * row_ + i)] = kacc_[size_t(i)] / float(P);
    kacc_.assign(size_t(row_), 0.0f);
  }
  const float* z = kz_.data() + page * row_;
  for (int64_t i = 0; i < row_; ++i) {
    ctr[i] = k[i] - z[i];
    kacc_[size_t(i)] += k[i];
  }
}

void KvCache::channel_encode(int64_t slot, int64_t h, const float* ctr, const float* v) {
  // One KV head of one slot (writes that slot's codes and scales only, so
  // the keys of a chunk encode in parallel): the key's codes and scale
  // against the factor of the query moments (least squares before any
  // query), the value's by least squares; scales from candidates rounded
  // to what stores them (K: f24, V: bf16).
  const size_t off = size_t(slot * row_ + h * hd_);
  const float* kh = ctr + h * hd_;
  const float* vh = v + h * hd_;
  uint8_t* kc = k_.data() + off;
  float sk;
  if (h < int64_t(qchol_.size()) && !qchol_[size_t(h)].empty()) {
    sk = fp8::e4m3_encode_qk_best_scale(kh, hd_, qchol_[size_t(h)].data(), kc);
  } else {
    sk = fp8::e4m3_mse_scale(kh, hd_, true);  // a bf16 value: an f24 one too
    fp8::e4m3_encode_scaled(kh, hd_, sk, kc);
  }
  const uint32_t k24 = fp8::f32_to_f24(sk);  // exact: sk is an f24 value
  uint8_t* ks = ks24_.data() + size_t(slot * ns_ + h) * 3;
  ks[0] = uint8_t(k24), ks[1] = uint8_t(k24 >> 8), ks[2] = uint8_t(k24 >> 16);
  const float sv = fp8::e4m3_mse_scale(vh, hd_, true);
  vs16_[size_t(slot * ns_ + h)] = f32_to_bf16(sv);
  fp8::e4m3_encode_scaled(vh, hd_, sv, v_.data() + off);
}

template <KvDType T>
const float* KvCache::row(bool key, int64_t slot, int64_t kvh, float* buf) const {
  const std::vector<uint8_t>& data = key ? k_ : v_;
  const std::vector<float>& scales = key ? ks_ : vs_;
  const size_t off = size_t(slot * row_ + kvh * hd_);
  if constexpr (T == KvDType::F32) {
    return reinterpret_cast<const float*>(data.data()) + off;
  } else if constexpr (T == KvDType::BF16) {
    cpu::simd::to_f32(DType::BF16, reinterpret_cast<const uint16_t*>(data.data()) + off, hd_, buf);
    return buf;
  } else if constexpr (T == KvDType::F16) {
    cpu::simd::to_f32(DType::F16, reinterpret_cast<const uint16_t*>(data.data()) + off, hd_, buf);
    return buf;
  } else {
    const size_t si = size_t(slot * ns_ + (ns_ == 1 ? 0 : kvh));
    float s;
    if (!channel_) {
      s = scales[si];
    } else if (key) {
      const uint8_t* ks = ks24_.data() + si * 3;
      s = fp8::f24_to_f32(uint32_t(ks[0]) | uint32_t(ks[1]) << 8 | uint32_t(ks[2]) << 16);
    } else {
      s = bf16_to_f32(vs16_[si]);
    }
    if (key && channel_)
      kv_kernels::fp8_e4m3_to_f32_offset(data.data() + off, hd_, s,
                                         kz_.data() + (slot / kFp8OffsetPage) * row_ + kvh * hd_, buf);
    else
      kv_kernels::fp8_e4m3_to_f32(data.data() + off, hd_, s, buf);
    return buf;
  }
}

void KvCache::dequantize(int64_t slot, float* k, float* v) const {
  if (slot < 0 || slot >= n_) fail("KvCache::dequantize: slot out of range");
  std::vector<float> buf(static_cast<size_t>(hd_));
  for (int64_t h = 0; h < nkv_; ++h) {
    const float *kr = nullptr, *vr = nullptr;
    switch (cfg_.dtype) {
      case KvDType::F32: kr = row<KvDType::F32>(true, slot, h, buf.data()); break;
      case KvDType::BF16: kr = row<KvDType::BF16>(true, slot, h, buf.data()); break;
      case KvDType::F16: kr = row<KvDType::F16>(true, slot, h, buf.data()); break;
      case KvDType::FP8: kr = row<KvDType::FP8>(true, slot, h, buf.data()); break;
    }
    std::memcpy(k + h * hd_, kr, size_t(hd_) * 4);
    switch (cfg_.dtype) {
      case KvDType::F32: vr = row<KvDType::F32>(false, slot, h, buf.data()); break;
      case KvDType::BF16: vr = row<KvDType::BF16>(false, slot, h, buf.data()); break;
      case KvDType::F16: vr = row<KvDType::F16>(false, slot, h, buf.data()); break;
      case KvDType::FP8: vr = row<KvDType::FP8>(false, slot, h, buf.data()); break;
    }
    std::memcpy(v + h * hd_, vr, size_t(hd_) * 4);
    if (rotated_) {  // stored as H k, H v: H is its own inverse
      kv_kernels::hadamard_ortho(k + h * hd_, hd_);
      kv_kernels::hadamard_ortho(v + h * hd_, hd_);
    }
  }
}

// ---------------------------------------------------------------- retention

void KvCache::evict_lowest_score() {
  // The cache holds B = cap_ positions and one more is arriving: of the B + 1,
  // slots [0, sinks) and the last R (the newcomer and slots [B-R+1, B)) are
  // protected; the middle is [sinks, B - R + 1), never empty since R <= B - sinks.
  const int64_t B = cap_, R = cfg_.evict_protected_recent(), lo = cfg_.sinks, hi = B - R + 1;
  int64_t victim = lo;
  for (int64_t s = lo + 1; s < hi; ++s)
    if (acc_[size_t(s)] < acc_[size_t(victim)]) victim = s;  // ties: the oldest goes
  const int64_t tail = B - 1 - victim;  // slots after the victim, shifted down by one
  if (tail > 0) {
    const size_t rb = size_t(row_) * el_;
    std::memmove(k_.data() + size_t(victim) * rb, k_.data() + size_t(victim + 1) * rb, size_t(tail) * rb);
    std::memmove(v_.data() + size_t(victim) * rb, v_.data() + size_t(victim + 1) * rb, size_t(tail) * rb);
    if (ns_ > 0) {
      std::memmove(ks_.data() + victim * ns_, ks_.data() + (victim + 1) * ns_, size_t(tail * ns_) * 4);
      std::memmove(vs_.data() + victim * ns_, vs_.data() + (victim + 1) * ns_, size_t(tail * ns_) * 4);
    }
    std::memmove(pos_.data() + victim, pos_.data() + victim + 1, size_t(tail) * sizeof(int64_t));
    std::memmove(acc_.data() + victim, acc_.data() + victim + 1, size_t(tail) * sizeof(float));
  }
  --n_;
}

void KvCache::append(int64_t pos, const float* k, const float* v) {
  if (pos <= last_pos_)
    fail("KvCache::append: position " + std::to_string(pos) + " does not follow " + std::to_string(last_pos_));
  int64_t slot = 0;
  switch (ret_) {
    case KvRetention::Full:
    case KvRetention::Quest:
      slot = n_;
      ensure_slots(n_ + 1);
      ++n_;
      break;
    case KvRetention::Window:
      slot = appended_ % cap_;
      n_ = std::min(n_ + 1, cap_);
      break;
    case KvRetention::Streaming: {
      const int64_t S = cfg_.sinks;
      slot = appended_ < S ? appended_ : S + (appended_ - S) % (cap_ - S);
      n_ = std::min(n_ + 1, cap_);
      break;
    }
    case KvRetention::SnapKV:
      if (!compressed_) {  // the prompt: every position
        slot = n_;
        ensure_slots(n_ + 1);
        ++n_;
      } else if (n_ < cap_) {
        slot = n_++;
      } else {  // the window share: overwrite its oldest
        const int64_t R = cfg_.snapkv_recent();
        slot = cap_ - R + ring_ % R;
        ++ring_;
      }
      break;
    case KvRetention::H2O:
    case KvRetention::Tova:
      if (n_ == cap_) evict_lowest_score();
      slot = n_++;
      acc_[size_t(slot)] = 0.0f;
      break;
  }
  switch (cfg_.dtype) {
    case KvDType::F32: store<KvDType::F32>(slot, k, v); break;
    case KvDType::BF16: store<KvDType::BF16>(slot, k, v); break;
    case KvDType::F16: store<KvDType::F16>(slot, k, v); break;
    case KvDType::FP8: store<KvDType::FP8>(slot, k, v); break;
  }
  if (ret_ == KvRetention::Quest) {
    switch (cfg_.dtype) {
      case KvDType::F32: update_page_bounds<KvDType::F32>(slot); break;
      case KvDType::BF16: update_page_bounds<KvDType::BF16>(slot); break;
      case KvDType::F16: update_page_bounds<KvDType::F16>(slot); break;
      case KvDType::FP8: update_page_bounds<KvDType::FP8>(slot); break;
    }
  }
  pos_[size_t(slot)] = pos;
  last_pos_ = pos;
  ++appended_;
}

void KvCache::append_chunk(const int64_t* pos, int64_t n, const float* k, const float* v, ThreadPool& pool) {
  if (n <= 0) return;
  if (!channel_ || ret_ != KvRetention::Full) {
    for (int64_t t = 0; t < n; ++t) append(pos[t], k + t * row_, v + t * row_);
    return;
  }
  // fp8 channel, full retention: slots n_ .. n_ + n in order. What depends
  // on the keys before (the page sums and offsets) runs in order here; the
  // roundings, each key's 17 scales x (error feedback + nearest) under the
  // queries' factor, run on the pool (one item per key and KV head).
  for (int64_t t = 0; t < n; ++t) {
    const int64_t prev = t == 0 ? last_pos_ : pos[t - 1];
    if (pos[t] <= prev)
      fail("KvCache::append: position " + std::to_string(pos[t]) + " does not follow " + std::to_string(prev));
  }
  const int64_t s0 = n_;
  ensure_slots(s0 + n);
  channel_factor();
  std::vector<float> rk(k, k + n * row_), rv(v, v + n * row_), ctr(static_cast<size_t>(n * row_));
  for (int64_t b = 0; b < 2 * n * nkv_; ++b)
    kv_kernels::hadamard_ortho((b < n * nkv_ ? rk.data() + b * hd_ : rv.data() + (b - n * nkv_) * hd_), hd_);
  for (int64_t t = 0; t < n; ++t) channel_center(s0 + t, rk.data() + t * row_, ctr.data() + t * row_);
  pool.parallel_for(n * nkv_, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / nkv_, h = i % nkv_;
      channel_encode(s0 + t, h, ctr.data() + t * row_, rv.data() + t * row_);
    }
  });
  for (int64_t t = 0; t < n; ++t) pos_[size_t(s0 + t)] = pos[t];
  n_ = s0 + n;
  appended_ += n;
  last_pos_ = pos[n - 1];
}

// ---------------------------------------------------------------- fp8 channel: query moments

void KvCache::add_query_moments(const float* q, int64_t tokens, int64_t num_heads) {
  if (!wants_query_moments()) return;
  check_heads(num_heads);
  const int64_t G = num_heads / nkv_;
  const int64_t tri = fp8::packed_triangle(hd_);
  if (qmom_.empty()) qmom_.assign(size_t(nkv_ * tri), 0.0f);
  std::vector<float> r(static_cast<size_t>(hd_));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < num_heads; ++h) {
      r.assign(q + (t * num_heads + h) * hd_, q + (t * num_heads + h + 1) * hd_);
      kv_kernels::hadamard_ortho(r.data(), hd_);  // keys are stored rotated
      fp8::add_outer_product(qmom_.data() + (h / G) * tri, r.data(), hd_);
    }
  qchol_valid_ = false;
}

// ---------------------------------------------------------------- snapkv

void KvCache::observe_query(const float* q, int64_t num_heads, float scale) {
  if (!observes_queries()) return;
  check_heads(num_heads);
  const int64_t W = KvConfig::kSnapObserved, w = num_heads * hd_;
  if (obs_heads_ != num_heads) {
    obs_heads_ = num_heads;
    obs_q_.assign(size_t(W * w), 0.0f);
    obs_n_ = 0;
  }
  std::memcpy(obs_q_.data() + (obs_n_ % W) * w, q, size_t(w) * 4);
  ++obs_n_;
  obs_scale_ = scale;
  obs_last_slot_ = n_ - 1;
}

void KvCache::begin_decode() {
  if (ret_ != KvRetention::SnapKV || compressed_) return;
  if (n_ > cap_) snapkv_compress();
  // Bounded from here on: B slots.
  ensure_slots(cap_);
  k_.resize(size_t(cap_ * row_) * el_); k_.shrink_to_fit();
  v_.resize(size_t(cap_ * row_) * el_); v_.shrink_to_fit();
  ks_.resize(size_t(cap_ * ns_)); ks_.shrink_to_fit();
  vs_.resize(size_t(cap_ * ns_)); vs_.shrink_to_fit();
  pos_.resize(size_t(cap_)); pos_.shrink_to_fit();
  obs_q_.clear(); obs_q_.shrink_to_fit();
  compressed_ = true;
  ring_ = 0;
}

void KvCache::snapkv_compress() {
  const int64_t n = n_, B = cap_;
  const int64_t W = KvConfig::kSnapObserved, nh = obs_heads_, G = nh > 0 ? nh / nkv_ : 0;
  // The observed queries belong to the last slots, the newest at obs_last_slot_.
  const int64_t nobs = obs_last_slot_ == n - 1 ? std::min({obs_n_, W, n}) : 0;
  std::vector<double> score(size_t(n), 0.0);
  std::vector<float> keys(static_cast<size_t>(n * row_)), vtmp(static_cast<size_t>(row_)), logit(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) dequantize(s, keys.data() + s * row_, vtmp.data());
  for (int64_t j = 0; j < nobs; ++j) {
    const int64_t t = n - nobs + j;  // the query's own slot: it saw slots [0, t]
    const float* q = obs_q_.data() + ((obs_n_ - nobs + j) % W) * nh * hd_;
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kvh = h / G;
      float mx = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {
        logit[size_t(s)] = cpu::simd::dot_f32(q + h * hd_, keys.data() + s * row_ + kvh * hd_, hd_) * obs_scale_;
        mx = std::max(mx, logit[size_t(s)]);
      }
      double z = 0;
      for (int64_t s = 0; s <= t; ++s) z += std::exp(double(logit[size_t(s)] - mx));
      for (int64_t s = 0; s <= t; ++s) score[size_t(s)] += std::exp(double(logit[size_t(s)] - mx)) / z;
    }
  }
  const std::vector<int64_t> keep = snapkv_keep(score.data(), n, cfg_);
  // keep is ascending and keep[i] >= i: moving row keep[i] to slot i in
  // order never overwrites a row still to be moved.
  const size_t rb = size_t(row_) * el_;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t from = keep[size_t(i)];
    if (from == i) continue;
    std::memcpy(k_.data() + size_t(i) * rb, k_.data() + size_t(from) * rb, rb);
    std::memcpy(v_.data() + size_t(i) * rb, v_.data() + size_t(from) * rb, rb);
    for (int64_t b = 0; b < ns_; ++b) {
      ks_[size_t(i * ns_ + b)] = ks_[size_t(from * ns_ + b)];
      vs_[size_t(i * ns_ + b)] = vs_[size_t(from * ns_ + b)];
    }
    pos_[size_t(i)] = pos_[size_t(from)];
  }
  n_ = B;
}

// ---------------------------------------------------------------- quest

template <KvDType T>
void KvCache::update_page_bounds(int64_t slot) {
  const int64_t P = cfg_.page, page = slot / P;
  if (int64_t(kmin_.size()) < (page + 1) * row_) {
    kmin_.resize(size_t((page + 1) * row_));
    kmax_.resize(size_t((page + 1) * row_));
  }
  if (scratch_.krow.size() < size_t(hd_)) scratch_.krow.resize(size_t(hd_));
  for (int64_t kvh = 0; kvh < nkv_; ++kvh) {
    // The key as attention will read it (decoded, stored basis).
    const float* kr = row<T>(true, slot, kvh, scratch_.krow.data());
    float* mn = kmin_.data() + page * row_ + kvh * hd_;
    float* mx = kmax_.data() + page * row_ + kvh * hd_;
    if (slot % P == 0) {
      std::memcpy(mn, kr, size_t(hd_) * 4);
      std::memcpy(mx, kr, size_t(hd_) * 4);
    } else {
      for (int64_t c = 0; c < hd_; ++c) {
        mn[c] = std::min(mn[c], kr[c]);
        mx[c] = std::max(mx[c], kr[c]);
      }
    }
  }
}

void KvCache::quest_select_pages(const float* q, int64_t num_heads) {
  const int64_t P = cfg_.page, G = num_heads / nkv_;
  // Always read: page 0 and the recent pages [recent0, ...), those holding
  // the last max(1, R) positions, R = floor(--kv-recent F x resident) (0
  // without --kv-recent: the newest page alone). Then whole middle pages
  // [1, recent0) while they fit (validate() keeps resident >= R + 2P, so
  // recent0 >= 2 when n_ > resident).
  const int64_t R = cfg_.recent_set ? int64_t(std::floor(cfg_.recent_fraction * double(cfg_.resident))) : 0;
  const int64_t recent0 = (n_ - std::max<int64_t>(1, R)) / P;
  const int64_t take = std::min(recent0 - 1, (cfg_.resident - P - (n_ - recent0 * P)) / P);
  if (rotated_) {  // the bounds are over H k: score with H q
    rot_.assign(q, q + num_heads * hd_);
    for (int64_t h = 0; h < num_heads; ++h) kv_kernels::hadamard_ortho(rot_.data() + h * hd_, hd_);
    q = rot_.data();
  }
  const bool per_head = cfg_.quest_select == QuestSelect::Head;
  const int64_t groups = per_head ? nkv_ : 1;
  sel_.resize(size_t(nkv_));
  page_bound_.assign(size_t(recent0), 0.0f);
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t h_begin = per_head ? gi * G : 0, h_end = per_head ? (gi + 1) * G : num_heads;
    for (int64_t j = 1; j < recent0; ++j) {
      float best = -INFINITY;
      for (int64_t h = h_begin; h < h_end; ++h) {
        const float* qh = q + h * hd_;
        const float* mn = kmin_.data() + j * row_ + (h / G) * hd_;
        const float* mx = kmax_.data() + j * row_ + (h / G) * hd_;
        float u = 0.0f;
        for (int64_t c = 0; c < hd_; ++c) u += std::max(qh[c] * mn[c], qh[c] * mx[c]);
        best = std::max(best, u);
      }
      page_bound_[size_t(j)] = best;
    }
    page_order_.resize(size_t(std::max<int64_t>(0, recent0 - 1)));
    std::iota(page_order_.begin(), page_order_.end(), int64_t(1));
    // Highest bound first; ties: the newer page.
    std::partial_sort(page_order_.begin(), page_order_.begin() + take, page_order_.end(), [&](int64_t a, int64_t b) {
      const float ua = page_bound_[size_t(a)], ub = page_bound_[size_t(b)];
      return ua != ub ? ua > ub : a > b;
    });
    std::sort(page_order_.begin(), page_order_.begin() + take);
    std::vector<int64_t>& out = sel_[size_t(per_head ? gi : 0)];
    out.clear();
    auto add_page = [&](int64_t j) {
      for (int64_t s = j * P; s < std::min(n_, (j + 1) * P); ++s) out.push_back(s);
    };
    add_page(0);
    for (int64_t i = 0; i < take; ++i) add_page(page_order_[size_t(i)]);
    for (int64_t j = recent0; j * P < n_; ++j) add_page(j);
  }
  if (!per_head)
    for (int64_t kvh = 1; kvh < nkv_; ++kvh) sel_[size_t(kvh)] = sel_[0];
}

std::vector<int64_t> KvCache::quest_selected(int64_t kvh) const {
  if (kvh < 0 || kvh >= nkv_) fail("KvCache::quest_selected: KV head out of range");
  if (ret_ != KvRetention::Quest || sel_all_ || sel_.empty()) {
    std::vector<int64_t> all(static_cast<size_t>(n_));
    std::iota(all.begin(), all.end(), int64_t(0));
    return all;
  }
  return sel_[size_t(kvh)];
}

// ---------------------------------------------------------------- attention

template <KvDType T>
void KvCache::attend_impl(const float* q, int64_t num_heads, float scale, float* out, int64_t slots,
                          AttendScratch& sc, const std::vector<int64_t>* sel) const {
  const int64_t G = num_heads / nkv_;
  // probs is [num_heads][stride]: each KV head's group reads its own n slots.
  int64_t stride = slots;
  if (sel) {
    stride = 0;
    for (int64_t kvh = 0; kvh < nkv_; ++kvh) stride = std::max(stride, int64_t(sel[kvh].size()));
  }
  std::fill(out, out + num_heads * hd_, 0.0f);
  if (stride == 0) return;
  if ((T != KvDType::F32 || sel) && sc.vtile.size() < size_t(kTile * hd_)) sc.vtile.resize(size_t(kTile * hd_));
  const bool rot = T == KvDType::FP8 && rotated_;
  if (rot) {  // scores against H k need H q
    sc.rot.assign(q, q + num_heads * hd_);
    for (int64_t h = 0; h < num_heads; ++h) kv_kernels::hadamard_ortho(sc.rot.data() + h * hd_, hd_);
    q = sc.rot.data();
  }
  if (sc.probs.size() < size_t(num_heads * stride)) sc.probs.resize(size_t(num_heads * stride));
  float* probs = sc.probs.data();
  for (int64_t kvh = 0; kvh < nkv_; ++kvh) {
    const int64_t h0 = kvh * G;
    const float* qg = q + h0 * hd_;
    const int64_t* idx = sel ? sel[kvh].data() : nullptr;  // i-th slot read: idx[i], or i
    const int64_t n = sel ? int64_t(sel[kvh].size()) : slots;
    if (n == 0) continue;
    // Rows [s0, s0 + nt) of K or V for this KV head as fp32, ld apart: f32
    // storage read in order is used in place (all n rows as one tile), the
    // other formats are decoded kTile rows at a time into the scratch tile.
    const bool in_place = T == KvDType::F32 && !idx;
    const int64_t step = in_place ? n : kTile;
    auto rows_at = [&](bool key, int64_t s0, int64_t nt, int64_t& ld) -> const float* {
      if (in_place) {
        ld = row_;
        return reinterpret_cast<const float*>((key ? k_ : v_).data()) + s0 * row_ + kvh * hd_;
      }
      for (int64_t r = 0; r < nt; ++r) {
        float* dst = sc.vtile.data() + r * hd_;
        const float* src = row<T>(key, idx ? idx[s0 + r] : s0 + r, kvh, dst);
        if (src != dst) std::memcpy(dst, src, size_t(hd_) * 4);
      }
      ld = hd_;
      return sc.vtile.data();
    };
    // Scores: each K row meets the G query heads of its group in the panel
    // kernel's 4 x 4 tiles (keys x heads): every score has the bits of
    // dot_f32(q head, K row), whichever way it is tiled; then the scale.
    for (int64_t s0 = 0; s0 < n; s0 += step) {
      const int64_t nt = std::min(step, n - s0);
      int64_t ld;
      const float* tile = rows_at(true, s0, nt, ld);
      cpu::simd::dot_panel_f32(tile, ld, nt, qg, hd_, G, hd_, probs + h0 * stride + s0, stride);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* p = probs + (h0 + g) * stride;
      for (int64_t i = 0; i < n; ++i) p[i] *= scale;
      const float mx = *std::max_element(p, p + n);
      const float inv = 1.0f / kv_kernels::exp_shifted_sum(p, n, mx);
      for (int64_t i = 0; i < n; ++i) p[i] *= inv;
    }
    // Values: the G heads of the group accumulate each tile together in
    // registers (each value row loaded once for all of them).
    for (int64_t s0 = 0; s0 < n; s0 += step) {
      const int64_t nt = std::min(step, n - s0);
      int64_t ld;
      const float* tile = rows_at(false, s0, nt, ld);
      kv_kernels::weighted_rows_acc_heads(tile, ld, probs + h0 * stride + s0, stride, G, nt, out + h0 * hd_, hd_);
    }
  }
  if (rot)  // out = H (sum_s p_s v_s): back to the model's basis
    for (int64_t h = 0; h < num_heads; ++h) kv_kernels::hadamard_ortho(out + h * hd_, hd_);
}

void KvCache::check_heads(int64_t num_heads) const {
  if (num_heads <= 0 || num_heads % nkv_ != 0)
    fail("KvCache::attend: " + std::to_string(num_heads) + " query heads is not a multiple of " +
         std::to_string(nkv_) + " KV heads");
}

void KvCache::attend_prefix(const float* q, int64_t num_heads, float scale, float* out, int64_t slots,
                            AttendScratch& scratch) const {
  check_heads(num_heads);
  if (!supports_prefix_attention())
    fail("KvCache::attend_prefix: needs full retention (a window or an eviction policy reorders slots)");
  if (slots < 0 || slots > n_)
    fail("KvCache::attend_prefix: " + std::to_string(slots) + " slots, the cache holds " + std::to_string(n_));
  switch (cfg_.dtype) {
    case KvDType::F32: return attend_impl<KvDType::F32>(q, num_heads, scale, out, slots, scratch);
    case KvDType::BF16: return attend_impl<KvDType::BF16>(q, num_heads, scale, out, slots, scratch);
    case KvDType::F16: return attend_impl<KvDType::F16>(q, num_heads, scale, out, slots, scratch);
    case KvDType::FP8: return attend_impl<KvDType::FP8>(q, num_heads, scale, out, slots, scratch);
  }
}

void KvCache::attend(const float* q, int64_t num_heads, float scale, float* out) {
  check_heads(num_heads);
  if (observes_queries()) observe_query(q, num_heads, scale);
  const std::vector<int64_t>* sel = nullptr;
  if (ret_ == KvRetention::Quest) {
    sel_all_ = n_ <= cfg_.resident;
    if (!sel_all_) {
      quest_select_pages(q, num_heads);
      sel = sel_.data();
    }
  }
  switch (cfg_.dtype) {
    case KvDType::F32: attend_impl<KvDType::F32>(q, num_heads, scale, out, n_, scratch_, sel); break;
    case KvDType::BF16: attend_impl<KvDType::BF16>(q, num_heads, scale, out, n_, scratch_, sel); break;
    case KvDType::F16: attend_impl<KvDType::F16>(q, num_heads, scale, out, n_, scratch_, sel); break;
    case KvDType::FP8: attend_impl<KvDType::FP8>(q, num_heads, scale, out, n_, scratch_, sel); break;
  }
  if (n_ == 0) return;
  if (ret_ == KvRetention::Tova) std::fill(acc_.begin(), acc_.begin() + n_, 0.0f);
  if (ret_ == KvRetention::H2O || ret_ == KvRetention::Tova) {
    const float* probs = scratch_.probs.data();
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* p = probs + h * n_;
      for (int64_t s = 0; s < n_; ++s) acc_[size_t(s)] += p[s];
    }
  }
}

}  // namespace flashmoe
