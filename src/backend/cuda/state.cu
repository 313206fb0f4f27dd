// A conversation's device state: KV caches (every dtype and retention
// policy), conv and delta-rule states, the token ring; copied to host
// memory and back (conversation snapshots).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/error.h"

namespace flashmoe {

CudaState::~CudaState() = default;
int64_t CudaState::position() const { return p_->pos; }


// Full retention: grow the KV storage (and scores) to hold `slots`.
void CudaModel::Impl::ensure_cap(CudaState::Impl& s, int64_t slots) {
  if (s.window > 0 || s.h2o || slots <= s.cap) return;
  int64_t nc = std::max<int64_t>(int64_t(s.cap) * 2, slots);
  nc = (nc + 255) / 256 * 256;
  if (nc > (int64_t(1) << 30)) fail_device(DeviceFailure::Unsupported, "CUDA backend: context too long (2^30 positions)");
  s.drop_graphs();
  const size_t row = size_t(s.nkv) * s.hd;
  for (KvLayer& l : s.kvl) {
    KvLayer n = l;
    n.cap = int(nc);
    n.k = dev_alloc(size_t(nc) * row * s.el, "KV cache");
    n.v = dev_alloc(size_t(nc) * row * s.el, "KV cache");
    n.ks = static_cast<float*>(dev_alloc(size_t(nc) * std::max(s.ns, 1) * 4, "KV scales"));
    n.vs = static_cast<float*>(dev_alloc(size_t(nc) * std::max(s.ns, 1) * 4, "KV scales"));
    const size_t used = size_t(std::min<int64_t>(s.pos, s.cap));
    if (used) {
      CK(cudaMemcpy(n.k, l.k, used * row * s.el, cudaMemcpyDeviceToDevice));
      CK(cudaMemcpy(n.v, l.v, used * row * s.el, cudaMemcpyDeviceToDevice));
      if (s.ns) {
        CK(cudaMemcpy(n.ks, l.ks, used * s.ns * 4, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(n.vs, l.vs, used * s.ns * 4, cudaMemcpyDeviceToDevice));
      }
    }
    for (void* p : {l.k, l.v, static_cast<void*>(l.ks), static_cast<void*>(l.vs)}) cudaFree(p);
    l = n;
  }
  cudaFree(s.scores);
  s.scores = static_cast<float*>(dev_alloc(size_t(nc) * std::max(s.nh, 1) * 4, "attention scores"));
  s.cap = int(nc);
}

std::unique_ptr<CudaState> CudaModel::new_state(const KvConfig& kv) const {
  const Impl& m = *p_;
  kv.validate();
  const KvRetention ret = kv.retention();
  if (kv.capacity() > (int64_t(1) << 30))
    fail_device(DeviceFailure::Unsupported, "CUDA backend: a KV cache of " + std::to_string(kv.capacity()) +
                                                " positions per layer is more than it supports (2^30)");
  CK(cudaSetDevice(m.dev));
  auto st = std::make_unique<CudaState>();
  st->p_ = std::make_unique<CudaState::Impl>();
  CudaState::Impl& s = *st->p_;
  s.dev = m.dev;
  s.kv = kv;
  s.nkv = int(m.c.num_kv_heads);
  s.hd = int(m.c.head_dim);
  s.nh = int(m.c.num_heads);
  switch (kv.dtype) {
    case KvDType::F32: s.kvt = KV_F32; s.el = 4; break;
    case KvDType::BF16: s.kvt = KV_BF16; s.el = 2; break;
    case KvDType::F16: s.kvt = KV_F16; s.el = 2; break;
    case KvDType::FP8: s.kvt = KV_FP8; s.el = 1; break;
  }
  if (kv.dtype == KvDType::FP8 && kv.fp8_scale == Fp8ScaleMode::Channel)
    fail_device(DeviceFailure::Unsupported, "CUDA backend: --kv-fp8-scale channel is not implemented (CPU only)");
  const bool rot = kv.dtype == KvDType::FP8 && kv.fp8_scale == Fp8ScaleMode::Rotated;
  if (rot && (m.c.head_dim & (m.c.head_dim - 1)) != 0)
    fail(std::string("--kv-fp8-scale rotated needs a power-of-two head_dim (this model's is ") +
         std::to_string(m.c.head_dim) + ")");
  if (ret == KvRetention::Quest)
    fail_device(DeviceFailure::Unsupported,
                "CUDA backend: --kv-resident (the Quest page store) is not implemented (CPU only)");
  // rotated: per-head scales over the rotated rows, as the CPU.
  s.ns = kv.dtype != KvDType::FP8 ? 0 : kv.fp8_scale == Fp8ScaleMode::Position ? 1 : s.nkv;
  if (s.ns > 64) fail_device(DeviceFailure::Unsupported, "CUDA backend: more than 64 KV heads with per-head fp8 scales is not supported");
  if (ret == KvRetention::Window) s.window = int(kv.window);
  if (ret == KvRetention::Streaming) {
    s.window = int(kv.window);
    s.sinks = int(kv.sinks);
  }
  s.h2o = kv.scored_eviction();  // h2o or tova: the same slots, victims and scores buffer
  if (s.h2o) s.sinks = int(kv.sinks);
  s.snap = ret == KvRetention::SnapKV;  // full until the prompt is cut (snapkv.cu)
  s.cap = s.window > 0 ? s.window : s.h2o ? int(kv.capacity()) : 1024;
  const size_t row = size_t(s.nkv) * s.hd;
  const int64_t C = m.c.lin_conv_dim(), Kc = m.c.conv_kernel;
  const int64_t ssm_n = m.c.lin_num_v_heads * m.c.lin_k_dim * m.c.lin_v_dim;
  for (const LayerPlan& lp : m.plan.layers) {  // in order: state_slot is the index in kvl / conv / ssm
    if (lp.mixer == MixerKind::GatedAttention) {
      KvLayer l{};
      l.cap = s.cap;
      l.window = s.window;
      l.sinks = s.sinks;
      l.rot = rot ? 1 : 0;
      // pushed first so that the destructor frees whatever was allocated
      s.kvl.push_back(l);
      KvLayer& b = s.kvl.back();
      b.k = dev_alloc(size_t(s.cap) * row * s.el, "KV cache");
      b.v = dev_alloc(size_t(s.cap) * row * s.el, "KV cache");
      b.ks = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.ns, 1) * 4, "KV scales"));
      b.vs = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.ns, 1) * 4, "KV scales"));
      if (s.h2o) {
        b.recent = int(kv.evict_protected_recent());
        b.latest_only = ret == KvRetention::Tova ? 1 : 0;
        b.acc = static_cast<float*>(dev_alloc(size_t(s.cap) * 4, "h2o scores"));
        b.kpos = static_cast<int*>(dev_alloc(size_t(s.cap) * 4, "h2o positions"));
        CK(cudaMemset(b.acc, 0, size_t(s.cap) * 4));
        CK(cudaMemset(b.kpos, 0xff, size_t(s.cap) * 4));  // -1: free
      }
      if (s.snap) {
        s.snap_q.push_back(static_cast<float*>(
            dev_alloc(size_t(KvConfig::kSnapObserved) * s.nh * s.hd * 4, "snapkv queries")));
        s.snap_fixed.emplace_back();
      }
    } else {
      // [C][K-1] in use (the K-1 previous inputs per channel); C * K floats
      // allocated, the size of the buffer in state images (save_state).
      s.conv.push_back(static_cast<float*>(dev_alloc(size_t(C * Kc) * 4, "conv state")));
      CK(cudaMemset(s.conv.back(), 0, size_t(C * Kc) * 4));
      s.ssm.push_back(static_cast<float*>(dev_alloc(size_t(ssm_n) * 4, "delta-rule state")));
      CK(cudaMemset(s.ssm.back(), 0, size_t(ssm_n) * 4));
    }
  }
  s.scores = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.nh, 1) * 4, "attention scores"));
  s.d_pos = static_cast<int*>(dev_alloc(4, "counters"));
  s.d_base = static_cast<int*>(dev_alloc(4, "counters"));
  s.d_step = static_cast<int*>(dev_alloc(4, "counters"));
  s.d_ids = static_cast<int*>(dev_alloc(size_t(kRing) * 4, "token ids"));
  s.d_out = static_cast<int*>(dev_alloc(size_t(kRing) * 4, "token ids"));
  for (int* p : {s.d_pos, s.d_base, s.d_step}) CK(cudaMemset(p, 0, 4));
  CK(cudaMemset(s.d_ids, 0, size_t(kRing) * 4));
  CK(cudaDeviceSynchronize());
  return st;
}

namespace {
// Bytes of each buffer of a state image, in save_state's order: per KV layer
// K, V (rows in use), the fp8 K, V scales and h2o's scores and positions;
// then each conv and delta-rule state; snapkv: each layer's query ring
// (empty once the prompt is cut).
std::vector<size_t> image_sizes(const ModelConfig& c, const CudaState::Impl& s, int64_t pos) {
  const int64_t held = pos - (s.snap_done ? s.snap_shift : 0);
  const size_t used = size_t(std::min<int64_t>(held, s.cap)), row = size_t(s.nkv) * s.hd * s.el;
  const size_t srow = s.ns ? size_t(s.ns) * 4 : 0, hrow = s.h2o ? 4 : 0;
  std::vector<size_t> z;
  for (size_t i = 0; i < s.kvl.size(); ++i)
    z.insert(z.end(), {used * row, used * row, used * srow, used * srow, used * hrow, used * hrow});
  const size_t conv = size_t(c.lin_conv_dim() * c.conv_kernel) * 4;
  const size_t ssm = size_t(c.lin_num_v_heads * c.lin_k_dim * c.lin_v_dim) * 4;
  for (size_t i = 0; i < s.conv.size(); ++i) z.push_back(conv);
  for (size_t i = 0; i < s.ssm.size(); ++i) z.push_back(ssm);
  for (size_t i = 0; i < s.snap_q.size(); ++i)
    z.push_back(s.snap_done ? 0 : size_t(KvConfig::kSnapObserved) * s.nh * s.hd * 4);
  return z;
}
// The device buffers of a state, in the same order.
std::vector<void*> image_buffers(const CudaState::Impl& s) {
  std::vector<void*> b;
  for (const KvLayer& l : s.kvl) b.insert(b.end(), {l.k, l.v, l.ks, l.vs, l.acc, l.kpos});
  for (float* p : s.conv) b.push_back(p);
  for (float* p : s.ssm) b.push_back(p);
  for (float* p : s.snap_q) b.push_back(p);
  return b;
}
// snapkv: whether the prompt was cut, the shift and each layer's kept
// prompt positions, as int64s (the last buffer of the image).
std::vector<uint8_t> snap_meta(const CudaState::Impl& s) {
  std::vector<int64_t> v = {s.snap_done ? 1 : 0, s.snap_shift};
  if (s.snap_done)
    for (const auto& f : s.snap_fixed) v.insert(v.end(), f.begin(), f.end());
  std::vector<uint8_t> b(v.size() * 8);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
}  // namespace

CudaStateImage CudaModel::save_state(const CudaState& st) const {
  const Impl& m = *p_;
  const CudaState::Impl& s = *st.p_;
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  CudaStateImage img;
  img.kv = s.kv;
  img.pos = s.pos;
  const std::vector<size_t> z = image_sizes(m.c, s, s.pos);
  const std::vector<void*> b = image_buffers(s);
  for (size_t i = 0; i < z.size(); ++i) {
    img.buffers.emplace_back(z[i]);
    if (z[i]) CK(cudaMemcpy(img.buffers.back().data(), b[i], z[i], cudaMemcpyDeviceToHost));
  }
  if (s.snap) img.buffers.push_back(snap_meta(s));
  return img;
}

std::unique_ptr<CudaState> CudaModel::load_state(const CudaStateImage& img) const {
  Impl& m = *p_;
  auto st = new_state(img.kv);
  CudaState::Impl& s = *st->p_;
  if (img.pos < 0 || img.pos >= (int64_t(1) << 30)) fail("conversation snapshot: bad position");
  size_t nbuf = img.buffers.size();
  if (s.snap) {  // the cut layout first, from the meta buffer (snap_meta)
    if (nbuf == 0 || img.buffers.back().size() < 16 || img.buffers.back().size() % 8)
      fail("conversation snapshot: taken from another model or KV configuration");
    const std::vector<uint8_t>& mb = img.buffers.back();
    std::vector<int64_t> v(mb.size() / 8);
    std::memcpy(v.data(), mb.data(), mb.size());
    --nbuf;
    if (v[0]) {
      const size_t per = size_t(s.kv.snapkv_budget - s.kv.snapkv_recent());
      if (v.size() != 2 + per * s.kvl.size() || v[1] < 0 || v[1] > img.pos)
        fail("conversation snapshot: taken from another model or KV configuration");
      m.snapkv_restore(s, v[1]);
      for (size_t l = 0; l < s.kvl.size(); ++l)
        s.snap_fixed[l].assign(v.begin() + std::ptrdiff_t(2 + l * per), v.begin() + std::ptrdiff_t(2 + (l + 1) * per));
    }
  }
  m.ensure_cap(s, img.pos);
  const std::vector<size_t> z = image_sizes(m.c, s, img.pos);
  const std::vector<void*> b = image_buffers(s);
  if (nbuf != z.size()) fail("conversation snapshot: taken from another model");
  for (size_t i = 0; i < z.size(); ++i) {
    if (img.buffers[i].size() != z[i]) fail("conversation snapshot: taken from another model or KV configuration");
    if (z[i]) CK(cudaMemcpy(b[i], img.buffers[i].data(), z[i], cudaMemcpyHostToDevice));
  }
  s.pos = img.pos;
  const int p32 = int(img.pos);
  CK(cudaMemcpy(s.d_pos, &p32, 4, cudaMemcpyHostToDevice));
  return st;
}

std::vector<int64_t> CudaModel::kv_positions(const CudaState& st, int layer) const {
  const Impl& m = *p_;
  const CudaState::Impl& s = *st.p_;
  if (layer < 0 || size_t(layer) >= s.kvl.size()) fail("kv_positions: no full-attention layer " + std::to_string(layer));
  std::vector<int64_t> out;
  if (s.h2o) {
    std::vector<int> kp(size_t(s.cap));
    CK(cudaSetDevice(m.dev));
    CK(cudaStreamSynchronize(m.stream));
    CK(cudaMemcpy(kp.data(), s.kvl[size_t(layer)].kpos, kp.size() * 4, cudaMemcpyDeviceToHost));
    for (int p : kp)
      if (p >= 0) out.push_back(p);
    std::sort(out.begin(), out.end());
    return out;
  }
  if (s.snap_done) {  // the kept prompt positions, then the last R (snapkv.cu)
    const int64_t R = s.kv.snapkv_recent(), B = s.kv.snapkv_budget;
    for (int64_t p : s.snap_fixed[size_t(layer)])
      if (p < s.pos) out.push_back(p);
    for (int64_t p = std::max(s.snap_shift + B - R, s.pos - R); p < s.pos; ++p) out.push_back(p);
    return out;
  }
  // The other policies place positions by formula (kv_slot).
  const int64_t W = s.window, S = s.sinks;
  for (int64_t p = 0; p < s.pos; ++p)
    if (W == 0 || p >= s.pos - (W - S) || p < S) out.push_back(p);
  return out;
}

}  // namespace flashmoe
