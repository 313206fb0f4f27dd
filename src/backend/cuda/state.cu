// A conversation's device state: KV caches (every dtype and retention
// policy), conv and delta-rule states, the token ring; copied to host
// memory and back (conversation snapshots).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/error.h"

namespace flashmoe {

CudaState::~CudaState() = default;
int64_t CudaState::position() const { return p_->pos; }


namespace {
// quest: pages of bounds for a capacity of cap slots (the newest page may
// be partial).
int quest_pages(int cap, int page) { return cap / page + 1; }

// quest: l.kmin / kmax / qub for l.cap slots; the bounds of the pages held
// so far copied from the old buffers (row pitch old qpcap), which are freed.
void grow_quest_pages(KvLayer& l, int nkv, int hd) {
  const int np = quest_pages(l.cap, l.qpage), op = l.qpcap;
  const size_t rows = size_t(nkv) * hd;
  for (float** b : {&l.kmin, &l.kmax}) {
    float* nb = static_cast<float*>(dev_alloc(rows * np * 4, "quest page bounds"));
    if (*b) CK(cudaMemcpy2D(nb, size_t(np) * 4, *b, size_t(op) * 4, size_t(op) * 4, rows, cudaMemcpyDeviceToDevice));
    cudaFree(*b);
    *b = nb;
  }
  cudaFree(l.qub);
  l.qub = static_cast<float*>(dev_alloc(size_t(nkv) * np * 4, "quest page scores"));
  l.qpcap = np;
}
}  // namespace

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
    if (l.quest) grow_quest_pages(n, s.nkv, s.hd);
    l = n;
  }
  cudaFree(s.scores);
  s.scores = static_cast<float*>(dev_alloc(size_t(nc) * std::max(s.nh, 1) * 4, "attention scores"));
  s.cap = int(nc);
}

namespace {
// A state's attention scores scratch, position counters and token rings
// (ring entries; one allocation), zeroed on `zero` (new_state waits for it).
void alloc_counters(CudaState::Impl& s, int ring, cudaStream_t zero) {
  s.scores = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.nh, 1) * 4, "attention scores"));
  const size_t n = 3 + 2 * size_t(ring);
  s.counters = dev_alloc(n * 4, "counters and token ids");
  s.counters_bytes = n * 4;
  int* c = static_cast<int*>(s.counters);
  s.d_pos = c, s.d_base = c + 1, s.d_step = c + 2, s.d_ids = c + 3, s.d_out = c + 3 + ring;
  CK(cudaMemsetAsync(c, 0, n * 4, zero));
}
}  // namespace

KvLayer CudaModel::Impl::new_kv_layer(const CudaState::Impl& s) const {
  const size_t row = size_t(s.nkv) * s.hd;
  KvLayer b{};
  b.cap = s.cap;
  b.window = s.window;
  b.sinks = s.sinks;
  b.rot = s.kv.dtype == KvDType::FP8 && s.kv.fp8_scale == Fp8ScaleMode::Rotated ? 1 : 0;
  struct Guard {  // frees what was allocated when a later allocation throws
    KvLayer& l;
    bool done = false;
    ~Guard() {
      if (!done)
        for (void* p : kv_layer_buffers(l)) cudaFree(p);
    }
  } g{b};
  b.k = dev_alloc(size_t(s.cap) * row * s.el, "KV cache");
  b.v = dev_alloc(size_t(s.cap) * row * s.el, "KV cache");
  b.ks = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.ns, 1) * 4, "KV scales"));
  b.vs = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.ns, 1) * 4, "KV scales"));
  if (s.h2o) {
    const KvRetention ret = s.kv.retention();
    b.recent = int(s.kv.evict_protected_recent());
    b.latest_only = ret == KvRetention::Tova ? 1 : 0;
    b.acc = static_cast<float*>(dev_alloc(size_t(s.cap) * 4, "h2o scores"));
    b.kpos = static_cast<int*>(dev_alloc(size_t(s.cap) * 4, "h2o positions"));
    CK(cudaMemsetAsync(b.acc, 0, size_t(s.cap) * 4, state_stream));
    CK(cudaMemsetAsync(b.kpos, 0xff, size_t(s.cap) * 4, state_stream));  // -1: free
  }
  if (s.kv.retention() == KvRetention::Quest) {
    const KvConfig& kv = s.kv;
    b.quest = int(kv.resident);
    b.qpage = int(kv.page);
    b.qrecent = kv.recent_set ? int(std::floor(kv.recent_fraction * double(kv.resident))) : 0;
    b.qlayer = kv.quest_select == QuestSelect::Layer ? 1 : 0;
    b.qmaxp = int(kv.resident / kv.page) + 2;
    grow_quest_pages(b, s.nkv, s.hd);
    b.qsel = static_cast<int*>(dev_alloc(size_t(s.nkv) * b.qmaxp * 4, "quest pages chosen"));
    b.qn = static_cast<int*>(dev_alloc(size_t(s.nkv) * 4, "quest pages chosen"));
    CK(cudaMemsetAsync(b.qn, 0, size_t(s.nkv) * 4, state_stream));
  }
  g.done = true;
  return b;
}

std::unique_ptr<CudaState> CudaModel::new_state(const KvConfig& kv, bool drafting) const {
  const Impl& m = *p_;
  kv.validate();
  const KvRetention ret = kv.retention();
  if (kv.capacity() > (int64_t(1) << 30))
    fail_device(DeviceFailure::Unsupported, "CUDA backend: a KV cache of " + std::to_string(kv.capacity()) +
                                                " positions per layer is more than it supports (2^30)");
  CK(cudaSetDevice(m.dev));
  auto st = std::make_unique<CudaState>();
  // A released state of this configuration (release_state), made as new:
  // position 0, its conv and delta-rule states and counters zeroed as a new
  // one's are, its graphs dropped. Its KV rows keep their stale contents (no
  // row at or past the position is read).
  if (!drafting && kv.retention() == KvRetention::Full)
    for (auto it = m.free_states.end(); it != m.free_states.begin();) {
      --it;
      // Full retention: the buffers follow the KV dtype and its fp8 scales alone.
      if ((*it)->kv.dtype != kv.dtype || (*it)->kv.fp8_scale != kv.fp8_scale) continue;
      st->p_ = std::move(*it);
      m.free_states.erase(it);
      CudaState::Impl& s = *st->p_;
      s.kv = kv;
      s.pos = 0;
      s.drop_graphs();
      CK(cudaStreamWaitEvent(m.state_stream, s.released, 0));
      if (s.recurrent) CK(cudaMemsetAsync(s.recurrent, 0, s.recurrent_bytes, m.state_stream));
      CK(cudaMemsetAsync(s.counters, 0, s.counters_bytes, m.state_stream));
      CK(cudaStreamSynchronize(m.state_stream));
      return st;
    }
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
  if (ret == KvRetention::Quest && kv.resident > (int64_t(1) << 30))
    fail_device(DeviceFailure::Unsupported, "CUDA backend: --kv-resident above 2^30 positions is not supported");
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
  s.cap_new = s.cap;
  const int64_t C = m.c.lin_conv_dim(), Kc = m.c.conv_kernel;
  const int64_t ssm_n = m.c.lin_num_v_heads * m.c.lin_k_dim * m.c.lin_v_dim;
  // [C][K-1] conv states in use (the K-1 previous inputs per channel); C * K
  // floats each, the size of the buffer in state images (save_state).
  auto round64 = [](size_t n) { return (n + 63) / 64 * 64; };  // 256-byte aligned pieces
  const size_t per_layer = round64(size_t(ssm_n)) + round64(size_t(C * Kc));
  const size_t linear = size_t(m.plan.delta_layers);
  if (linear) {
    s.recurrent_bytes = linear * per_layer * 4;
    s.recurrent = dev_alloc(s.recurrent_bytes, "conv and delta-rule states");
    CK(cudaMemsetAsync(s.recurrent, 0, s.recurrent_bytes, m.state_stream));
  }
  float* rec = static_cast<float*>(s.recurrent);
  for (const LayerPlan& lp : m.plan.layers) {  // in order: state_slot is the index in kvl / conv / ssm
    if (lp.mixer == MixerKind::GatedAttention) {
      s.kvl.push_back(KvLayer{});  // first, so that the destructor frees whatever was allocated
      s.kvl.back() = m.new_kv_layer(s);
      if (s.snap) {
        s.snap_q.push_back(static_cast<float*>(
            dev_alloc(size_t(KvConfig::kSnapObserved) * s.nh * s.hd * 4, "snapkv queries")));
        s.snap_fixed.emplace_back();
      }
    } else {
      s.ssm.push_back(rec);
      s.conv.push_back(rec + round64(size_t(ssm_n)));
      rec += per_layer;
    }
  }
  alloc_counters(s, kRing, m.state_stream);
  if (drafting) {
    if (m.tiers)
      fail_device(DeviceFailure::Unsupported,
                  "CUDA backend: --mtp with routed experts outside VRAM (--gpu-expert-cache) is not implemented");
    if (!m.mtp) fail("--mtp: the model has no MTP head (no mtp.* tensors in its checkpoint)");
    if (s.h2o) fail_device(DeviceFailure::Unsupported, "CUDA backend: --mtp with h2o or tova retention is not implemented");
    if (ret == KvRetention::Quest)
      fail_device(DeviceFailure::Unsupported, "CUDA backend: --mtp with --kv-resident is not implemented");
    s.head = std::make_unique<CudaState::Impl>();
    CudaState::Impl& h = *s.head;
    h.dev = s.dev, h.kv = s.kv, h.cap = s.cap, h.window = s.window, h.sinks = s.sinks, h.kvt = s.kvt, h.ns = s.ns;
    h.el = s.el, h.nkv = s.nkv, h.hd = s.hd, h.nh = s.nh;
    h.kvl.push_back(KvLayer{});
    h.kvl.back() = m.new_kv_layer(h);
    alloc_counters(h, 1, m.state_stream);
    s.head_hidden = static_cast<float*>(dev_alloc(size_t(m.c.hidden_size) * 4, "MTP hidden state"));
  }
  // The zeroing done (its own stream: not behind a step in flight on the
  // model's; later copies into the state may come from any stream).
  CK(cudaStreamSynchronize(m.state_stream));
  return st;
}

void CudaModel::release_state(std::unique_ptr<CudaState> st) const noexcept {
  if (!st || !st->p_) return;
  const Impl& m = *p_;
  CudaState::Impl& s = *st->p_;
  // Not one whose KV grew: the attention's blocks per head follow the
  // capacity, so its sums would not be a new state's, bit for bit.
  const bool plain = !s.head && !s.h2o && !s.snap && s.kv.retention() == KvRetention::Full && s.cap == s.cap_new &&
                     s.bak.empty() && s.conv_rows.empty() && s.ssm_rows.empty() && !s.head_rows && !s.verify_scores &&
                     !s.verify_jobs;
  if (!plain || s.dev != m.dev || m.free_states.size() >= kFreeStates) return;  // freed with st
  // From a destructor: no exceptions; a device that fails here gets the
  // state freed as before.
  if (cudaSetDevice(m.dev) != cudaSuccess) return;
  if (!s.released && cudaEventCreateWithFlags(&s.released, cudaEventDisableTiming) != cudaSuccess) {
    s.released = nullptr;
    return;
  }
  if (cudaEventRecord(s.released, m.stream) != cudaSuccess) return;
  try {
    m.free_states.push_back(std::move(st->p_));
  } catch (const std::bad_alloc&) {  // st still holds it: freed
  }
}

size_t CudaModel::free_states() const { return p_->free_states.size(); }

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
  if (s.head) {  // the MTP head's entries 0 .. pos-2, and the hidden state of the last token
    const std::vector<size_t> h = image_sizes(c, *s.head, std::max<int64_t>(pos - 1, 0));
    z.insert(z.end(), h.begin(), h.end());
    z.push_back(pos > 0 ? size_t(c.hidden_size) * 4 : 0);
  }
  return z;
}
// The device buffers of a state, in the same order.
std::vector<void*> image_buffers(const CudaState::Impl& s) {
  std::vector<void*> b;
  for (const KvLayer& l : s.kvl) b.insert(b.end(), {l.k, l.v, l.ks, l.vs, l.acc, l.kpos});
  for (float* p : s.conv) b.push_back(p);
  for (float* p : s.ssm) b.push_back(p);
  for (float* p : s.snap_q) b.push_back(p);
  if (s.head) {
    const std::vector<void*> h = image_buffers(*s.head);
    b.insert(b.end(), h.begin(), h.end());
    b.push_back(s.head_hidden);
  }
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
  img.drafting = bool(s.head);
  const std::vector<size_t> z = image_sizes(m.c, s, s.pos);
  const std::vector<void*> b = image_buffers(s);
  for (size_t i = 0; i < z.size(); ++i) {
    img.buffers.emplace_back(z[i]);
    if (z[i]) CK(cudaMemcpy(img.buffers.back().data(), b[i], z[i], cudaMemcpyDeviceToHost));
  }
  if (s.snap) img.buffers.push_back(snap_meta(s));
  return img;
}

namespace {
// A new state from an image's parts (either copy): kv, pos and drafting as
// taken, each buffer's bytes, snapkv's layout (null: none), and how buffer
// i reaches its device buffer (copies queued on m.stream or synchronous).
std::unique_ptr<CudaState> load_image(const CudaModel& model, CudaModel::Impl& m, const KvConfig& kv, int64_t pos,
                                      bool drafting, const std::vector<size_t>& sizes,
                                      const std::vector<uint8_t>* meta,
                                      const std::function<void(size_t i, void* dst)>& fill) {
  auto st = model.new_state(kv, drafting);
  CudaState::Impl& s = *st->p_;
  if (pos < 0 || pos >= (int64_t(1) << 30)) fail("conversation snapshot: bad position");
  if (s.snap) {  // the cut layout first, from the meta buffer (snap_meta)
    if (!meta || meta->size() < 16 || meta->size() % 8)
      fail("conversation snapshot: taken from another model or KV configuration");
    std::vector<int64_t> v(meta->size() / 8);
    std::memcpy(v.data(), meta->data(), meta->size());
    if (v[0]) {
      const size_t per = size_t(s.kv.snapkv_budget - s.kv.snapkv_recent());
      if (v.size() != 2 + per * s.kvl.size() || v[1] < 0 || v[1] > pos)
        fail("conversation snapshot: taken from another model or KV configuration");
      m.snapkv_restore(s, v[1]);
      for (size_t l = 0; l < s.kvl.size(); ++l)
        s.snap_fixed[l].assign(v.begin() + std::ptrdiff_t(2 + l * per), v.begin() + std::ptrdiff_t(2 + (l + 1) * per));
    }
  } else if (meta && !meta->empty()) {
    fail("conversation snapshot: taken from another model or KV configuration");
  }
  m.ensure_cap(s, pos);
  if (s.head) m.ensure_cap(*s.head, pos);
  const std::vector<size_t> z = image_sizes(m.c, s, pos);
  const std::vector<void*> b = image_buffers(s);
  if (sizes.size() != z.size()) fail("conversation snapshot: taken from another model");
  for (size_t i = 0; i < z.size(); ++i)
    if (sizes[i] != z[i]) fail("conversation snapshot: taken from another model or KV configuration");
  for (size_t i = 0; i < z.size(); ++i)
    if (z[i]) fill(i, b[i]);
  s.pos = pos;
  const int p32 = int(pos);
  CK(cudaMemcpy(s.d_pos, &p32, 4, cudaMemcpyHostToDevice));
  // quest: the page bounds are not in the image; recomputed from the keys.
  if (p32 > 0)
    for (const KvLayer& l : s.kvl)
      if (l.quest)
        quest_bounds_kernel<<<quest_bounds_blocks(l, s.nkv, 0, p32), 256, 0, m.stream>>>(l, s.kvt, s.nkv, s.hd, s.ns,
                                                                                        0, p32);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(m.stream));
  if (s.head) s.head->pos = std::max<int64_t>(pos - 1, 0);
  return st;
}

// Offsets of the buffers in a device image's one allocation (256-byte
// aligned, as cudaMalloc's own); the last entry is the allocation's size.
std::vector<size_t> device_offsets(const std::vector<size_t>& z) {
  std::vector<size_t> off(z.size() + 1, 0);
  for (size_t i = 0; i < z.size(); ++i) off[i + 1] = off[i] + (z[i] + 255) / 256 * 256;
  return off;
}
}  // namespace

std::unique_ptr<CudaState> CudaModel::load_state(const CudaStateImage& img) const {
  std::vector<size_t> sizes;
  for (const auto& b : img.buffers) sizes.push_back(b.size());
  const std::vector<uint8_t>* meta = nullptr;
  if (img.kv.retention() == KvRetention::SnapKV) {  // the last buffer is the cut layout
    if (sizes.empty()) fail("conversation snapshot: taken from another model or KV configuration");
    sizes.pop_back();
    meta = &img.buffers.back();
  }
  return load_image(*this, *p_, img.kv, img.pos, img.drafting, sizes, meta, [&](size_t i, void* dst) {
    CK(cudaMemcpy(dst, img.buffers[i].data(), img.buffers[i].size(), cudaMemcpyHostToDevice));
  });
}

size_t CudaModel::state_image_bytes(const CudaState& st) const {
  const CudaState::Impl& s = *st.p_;
  size_t n = s.snap ? snap_meta(s).size() : 0;
  for (size_t z : image_sizes(p_->c, s, s.pos)) n += z;
  return n;
}

void CudaModel::vram(int64_t* free_bytes, int64_t* total_bytes) const {
  CK(cudaSetDevice(p_->dev));
  size_t fr = 0, tot = 0;
  CK(cudaMemGetInfo(&fr, &tot));
  *free_bytes = int64_t(fr), *total_bytes = int64_t(tot);
}

CudaDeviceImage::~CudaDeviceImage() {
  if (!data) return;
  cudaSetDevice(dev);
  cudaFree(data);  // waits for the device: no copy from it is still queued
}

std::unique_ptr<CudaDeviceImage> CudaModel::save_state_device(const CudaState& st) const {
  const Impl& m = *p_;
  const CudaState::Impl& s = *st.p_;
  CK(cudaSetDevice(m.dev));
  auto img = std::make_unique<CudaDeviceImage>();
  img->kv = s.kv;
  img->pos = s.pos;
  img->drafting = bool(s.head);
  img->dev = m.dev;
  img->sizes = image_sizes(m.c, s, s.pos);
  if (s.snap) img->meta = snap_meta(s);
  const std::vector<size_t> off = device_offsets(img->sizes);
  if (cudaMalloc(&img->data, std::max<size_t>(off.back(), 16)) != cudaSuccess) {
    cudaGetLastError();  // out of memory here is not an error of the stream: the host copy serves
    img->data = nullptr;
    return nullptr;
  }
  // Queued behind the state's last step on the same stream; what the next
  // step writes comes after them.
  const std::vector<void*> b = image_buffers(s);
  for (size_t i = 0; i < img->sizes.size(); ++i)
    if (img->sizes[i])
      CK(cudaMemcpyAsync(static_cast<uint8_t*>(img->data) + off[i], b[i], img->sizes[i], cudaMemcpyDeviceToDevice,
                         m.stream));
  return img;
}

std::unique_ptr<CudaState> CudaModel::load_state(const CudaDeviceImage& img) const {
  Impl& m = *p_;
  if (img.dev != m.dev || !img.data) fail("conversation snapshot: taken on another device");
  const std::vector<size_t> off = device_offsets(img.sizes);
  return load_image(*this, m, img.kv, img.pos, img.drafting, img.sizes, img.meta.empty() ? nullptr : &img.meta,
                    [&](size_t i, void* dst) {
                      CK(cudaMemcpyAsync(dst, static_cast<const uint8_t*>(img.data) + off[i], img.sizes[i],
                                         cudaMemcpyDeviceToDevice, m.stream));
                    });
}

CudaStateImage CudaModel::download(const CudaDeviceImage& img) const {
  const Impl& m = *p_;
  if (img.dev != m.dev || !img.data) fail("conversation snapshot: taken on another device");
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));  // the copies into it
  CudaStateImage out;
  out.kv = img.kv;
  out.pos = img.pos;
  out.drafting = img.drafting;
  const std::vector<size_t> off = device_offsets(img.sizes);
  for (size_t i = 0; i < img.sizes.size(); ++i) {
    out.buffers.emplace_back(img.sizes[i]);
    if (img.sizes[i])
      CK(cudaMemcpy(out.buffers.back().data(), static_cast<const uint8_t*>(img.data) + off[i], img.sizes[i],
                    cudaMemcpyDeviceToHost));
  }
  if (img.kv.retention() == KvRetention::SnapKV) out.buffers.push_back(img.meta);
  return out;
}

namespace {
// What a restore point copies, with the bytes of each (mark_rollback's order).
std::vector<std::pair<void*, size_t>> rollback_buffers(const ModelConfig& c, CudaState::Impl& s) {
  std::vector<std::pair<void*, size_t>> b;
  const size_t conv = size_t(c.lin_conv_dim() * c.conv_kernel) * 4;
  const size_t ssm = size_t(c.lin_num_v_heads * c.lin_k_dim * c.lin_v_dim) * 4;
  for (float* p : s.conv) b.emplace_back(p, conv);
  for (float* p : s.ssm) b.emplace_back(p, ssm);
  auto windowed = [&](CudaState::Impl& x) {
    if (x.window == 0) return;  // full: rows past the position are free
    const size_t kv = size_t(x.cap) * x.nkv * x.hd * x.el, sc = size_t(x.cap) * std::max(x.ns, 1) * 4;
    for (KvLayer& l : x.kvl) {
      b.emplace_back(l.k, kv);
      b.emplace_back(l.v, kv);
      b.emplace_back(l.ks, sc);
      b.emplace_back(l.vs, sc);
    }
  };
  windowed(s);
  if (s.head) {
    windowed(*s.head);
    b.emplace_back(s.head_hidden, size_t(c.hidden_size) * 4);
  }
  return b;
}
}  // namespace

void CudaModel::mark_rollback(CudaState& st) const {
  const Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  if (s.h2o) fail("CUDA backend: a device restore point of an h2o/tova cache (its slots move): take a snapshot");
  CK(cudaSetDevice(m.dev));
  const auto bufs = rollback_buffers(m.c, s);
  if (s.bak.empty()) {
    s.bak.assign(bufs.size(), nullptr);
    for (size_t i = 0; i < bufs.size(); ++i) s.bak[i] = dev_alloc(bufs[i].second, "restore point");
  }
  for (size_t i = 0; i < bufs.size(); ++i)
    CK(cudaMemcpyAsync(s.bak[i], bufs[i].first, bufs[i].second, cudaMemcpyDeviceToDevice, m.stream));
  s.bak_pos = s.pos;
}

void CudaModel::rollback(CudaState& st) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  if (s.bak_pos < 0) fail("CUDA backend: roll-back without a restore point");
  if (s.pos < s.bak_pos) fail("CUDA backend: roll-back to a restore point ahead of the state");
  CK(cudaSetDevice(m.dev));
  const auto bufs = rollback_buffers(m.c, s);
  for (size_t i = 0; i < bufs.size(); ++i)
    CK(cudaMemcpyAsync(bufs[i].first, s.bak[i], bufs[i].second, cudaMemcpyDeviceToDevice, m.stream));
  s.pos = s.bak_pos;
  s.verify_n = 0;
  m.pinned_ids[0] = int32_t(s.pos);
  CK(cudaMemcpyAsync(s.d_pos, m.pinned_ids, 4, cudaMemcpyHostToDevice, m.stream));
  CK(cudaStreamSynchronize(m.stream));  // before pinned_ids is written again
  if (s.head) s.head->pos = std::max<int64_t>(s.pos - 1, 0);
}

int64_t CudaModel::rollback_position(const CudaState& st) const { return st.p_->bak_pos; }

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

std::vector<int64_t> CudaModel::kv_selected(const CudaState& st, int layer, int kv_head) const {
  const Impl& m = *p_;
  const CudaState::Impl& s = *st.p_;
  if (layer < 0 || size_t(layer) >= s.kvl.size()) fail("kv_selected: no full-attention layer " + std::to_string(layer));
  if (kv_head < 0 || kv_head >= s.nkv) fail("kv_selected: no KV head " + std::to_string(kv_head));
  const KvLayer& l = s.kvl[size_t(layer)];
  if (!l.quest) fail("kv_selected: the cache is not a Quest store (--kv-resident)");
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  int n = 0;
  std::vector<int> pages(size_t(l.qmaxp));
  CK(cudaMemcpy(&n, l.qn + kv_head, 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(pages.data(), l.qsel + size_t(kv_head) * l.qmaxp, pages.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) out[size_t(i)] = int64_t(pages[size_t(i / l.qpage)]) * l.qpage + i % l.qpage;
  return out;
}

}  // namespace flashmoe
