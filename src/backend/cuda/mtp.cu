// The MTP head on the device (--mtp): its weights uploaded beside the
// model's, its KV cache kept in step with what a drafting state consumes,
// and drafting. The head's decoder layer runs through the decode step's own
// functions (attention(), routed_moe() / dense_mlp(), matvec() in
// decode_step.cu) on the head's state, as plain launches (no graph: a draft
// waits for the host's pick after every step anyway). Same semantics as the
// CPU's backend/cpu/mtp.cpp.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/argmax.h"
#include "core/error.h"
#include "model/plan.h"

namespace flashmoe {

DLayer upload_layer(CudaModel::Impl& m, const LayerPlan& l, const LayerWeights& lw, ExpertStore& store, int64_t i,
                    const std::string& p, bool may_tier, bool& tiered, size_t& tier_gu, size_t& tier_dn);

namespace {

// out[0, H) = rms_norm(embed[*tok]) * (1 + we), out[H, 2H) = rms_norm(h) * (1 + wh): fc's input.
template <typename T>
__global__ void mtp_input_kernel(const T* __restrict__ E, int H, const int* __restrict__ tok,
                                 const float* __restrict__ h, const float* __restrict__ we,
                                 const float* __restrict__ wh, float eps, float* __restrict__ out) {
  pdl_wait();
  const T* e = E + size_t(*tok) * H;
  float se = 0.f, sh = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float a = to_f<T>(e[i]), b = h[i];
    se += a * a;
    sh += b * b;
  }
  se = block_sum(se);
  sh = block_sum(sh);
  const float re = 1.0f / sqrtf(se / float(H) + eps), rh = 1.0f / sqrtf(sh / float(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    out[i] = to_f<T>(e[i]) * re * (1.0f + we[i]);
    out[H + i] = h[i] * rh * (1.0f + wh[i]);
  }
}

// y = rms_norm(x) * (1 + w) over H.
__global__ void norm_kernel(const float* __restrict__ x, const float* __restrict__ w, int H, float eps,
                            float* __restrict__ y) {
  pdl_wait();
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss += x[i] * x[i];
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) y[i] = x[i] * r * (1.0f + w[i]);
}

// Greedy drafting: the head's argmax (block_argmax's ties) becomes the next
// step's token and draft k.
__global__ void draft_argmax_kernel(const float* __restrict__ logits, int V, int* tok, int* drafted) {
  pdl_wait();
  const int bi = block_argmax(logits, V);
  if (threadIdx.x == 0) *tok = *drafted = bi;
}

__global__ void set_pos_kernel(int* p, int v) {
  pdl_wait();
  *p = v;
}

// Bytes of a KV layer's K (= V) and of its scales, at capacity.
std::pair<size_t, size_t> kv_layer_bytes(const CudaState::Impl& s) {
  return {size_t(s.cap) * s.nkv * s.hd * s.el, size_t(s.cap) * std::max(s.ns, 1) * 4};
}

}  // namespace

void CudaModel::Impl::upload_mtp(const QwenModel& model) {
  const MtpWeights& w = *model.weights().mtp;
  const LayerPlan& l = *model.plan().mtp;
  auto d = std::make_unique<DeviceMtp>();
  d->fc = upload_rows({w.fc}, "MTP fc", -1, true);
  if (d->fc.dt == DT_GGUF) fail_device(DeviceFailure::Unsupported, "CUDA backend: the MTP head's fc in GGUF blocks");
  d->norm_embedding = upload_vec(w.norm_embedding, "MTP norm");
  d->norm_hidden = upload_vec(w.norm_hidden, "MTP norm");
  d->final_norm = upload_vec(w.final_norm, "MTP norm");
  bool tiered = false;  // the head's experts all in VRAM
  size_t gu = 0, dn = 0;
  // A dense head has no expert store of its own (the main one then goes unread).
  ExpertStore& store = model.mtp_expert_store() ? *model.mtp_expert_store() : model.expert_store();
  d->layer = upload_layer(*this, l, w.layer, store, 0, "MTP layer ", false, tiered, gu, dn);
  d->ffn = l.ffn;
  alloc_mtp_buffers(*d);
  mtp = std::move(d);
}

void CudaModel::Impl::alloc_mtp_buffers(DeviceMtp& d) {
  const int H = int(c.hidden_size);
  d.in = alloc_f(size_t(2 * H), "MTP activations");
  d.out = alloc_f(size_t(H), "MTP activations");
  d.hn = alloc_f(size_t(H), "MTP activations");
  d.tok = static_cast<int*>(alloc(4, "MTP token"));
  CK(cudaMemset(d.tok, 0, 4));
  d.drafted = static_cast<int*>(alloc(kDeviceDrafts * 4, "MTP drafts"));
}

void CudaModel::Impl::head_step(CudaState::Impl& hs, const float* hidden, const int* tok, int hpos, bool full) {
  DeviceMtp& h = *mtp;
  const int H = int(c.hidden_size);
  const float eps = c.rms_norm_eps;
  pdl_next = false;
  go(set_pos_kernel, 1, 1, 0, hs.d_pos, hpos);
  switch (embed.dt) {
    case DT_F32:
      go(mtp_input_kernel<float>, 1, 1024, 0, static_cast<const float*>(embed.p), H, tok, hidden, h.norm_embedding,
         h.norm_hidden, eps, h.in);
      break;
    case DT_F16:
      go(mtp_input_kernel<__half>, 1, 1024, 0, static_cast<const __half*>(embed.p), H, tok, hidden, h.norm_embedding,
         h.norm_hidden, eps, h.in);
      break;
    case DT_BF16:
      go(mtp_input_kernel<__nv_bfloat16>, 1, 1024, 0, static_cast<const __nv_bfloat16*>(embed.p), H, tok, hidden,
         h.norm_embedding, h.norm_hidden, eps, h.in);
      break;
    default:
      fail_device(DeviceFailure::Unsupported, "CUDA backend: --mtp with an embedding in GGUF blocks is not implemented");
  }
  matvec(h.fc, h.in, nullptr, x, 0, K_PROJ);
  attention(hs, h.layer, 0);
  if (!full) return;
  switch (h.ffn) {
    case FfnKind::RoutedMoE: routed_moe(h.layer, 0); break;
    case FfnKind::DenseSwiGLU: dense_mlp(h.layer); break;
  }
  go(norm_kernel, 1, 1024, 0, static_cast<const float*>(x), static_cast<const float*>(h.final_norm), H, eps, h.out);
  matvec(lm_head, h.out, nullptr, logits, 0, K_LMHEAD);
}

void CudaModel::Impl::advance_head(CudaState::Impl& s, const int* tok, int64_t pos, const float* x_last) {
  const int H = int(c.hidden_size);
  // The final norm first: x_last may be x, which the head's step overwrites.
  pdl_next = false;
  go(norm_kernel, 1, 1024, 0, x_last, static_cast<const float*>(final_norm), H, c.rms_norm_eps, mtp->hn);
  if (pos > 0) {  // the first token of all completes no entry
    head_step(*s.head, s.head_hidden, tok, int(pos - 1), false);
    s.head->pos = pos;
  }
  CK(cudaMemcpyAsync(s.head_hidden, mtp->hn, size_t(H) * 4, cudaMemcpyDeviceToDevice, stream));
}

bool CudaModel::has_mtp() const { return bool(p_->mtp); }

void CudaModel::draft(CudaState& st, int32_t next, int64_t n, const CudaDraftPicker& pick, int32_t* drafted) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  if (!s.head) fail("draft: the state was not made for drafting (--mtp)");
  if (s.pos == 0) fail("draft: feed a prompt first");
  check_token_ids(m.c, &next, 1);
  if (n <= 0) return;
  CK(cudaSetDevice(m.dev));
  CudaState::Impl& hs = *s.head;
  const int64_t h0 = s.pos - 1;  // the head's position for the first draft
  m.ensure_cap(hs, h0 + n);
  // The drafts' entries lie past the head's committed ones: in a full
  // cache in free slots, in a window over slots still in use, so there the
  // drafts run on a copy of the layer.
  const bool copy = hs.window > 0;
  if (copy) {
    if (!s.head_scratch.k) s.head_scratch = m.new_kv_layer(hs);
    const auto [kv, sc] = kv_layer_bytes(hs);
    const KvLayer& a = hs.kvl[0];
    KvLayer& b = s.head_scratch;
    CK(cudaMemcpyAsync(b.k, a.k, kv, cudaMemcpyDeviceToDevice, m.stream));
    CK(cudaMemcpyAsync(b.v, a.v, kv, cudaMemcpyDeviceToDevice, m.stream));
    CK(cudaMemcpyAsync(b.ks, a.ks, sc, cudaMemcpyDeviceToDevice, m.stream));
    CK(cudaMemcpyAsync(b.vs, a.vs, sc, cudaMemcpyDeviceToDevice, m.stream));
    std::swap(hs.kvl[0], s.head_scratch);
  }
  struct SwapBack {
    CudaState::Impl& s;
    bool on;
    ~SwapBack() {
      if (on) std::swap(s.head->kvl[0], s.head_scratch);
    }
  } back{s, copy};
  const int64_t V = m.c.vocab_size;
  // No picker: each step's argmax on the device feeds the next step, one
  // copy of the ids at the end (no host round trip per draft).
  const bool on_device = !pick && n <= kDeviceDrafts;
  int32_t tok = next;
  const float* hidden = s.head_hidden;
  for (int64_t k = 0; k < n; ++k) {
    if (k == 0 || !on_device) {
      m.pinned_ids[0] = tok;
      CK(cudaMemcpyAsync(m.mtp->tok, m.pinned_ids, 4, cudaMemcpyHostToDevice, m.stream));
    }
    m.head_step(hs, hidden, m.mtp->tok, int(h0 + k), true);
    hidden = m.mtp->out;  // read by the next step's first kernel, rewritten by its last
    if (on_device) {
      m.go(draft_argmax_kernel, 1, 1024, 0, static_cast<const float*>(m.logits), int(V), m.mtp->tok,
           m.mtp->drafted + k);
      continue;
    }
    CK(cudaMemcpyAsync(m.pinned_logits, m.logits, size_t(V) * 4, cudaMemcpyDeviceToHost, m.stream));
    CK(cudaStreamSynchronize(m.stream));
    tok = drafted[k] = pick ? pick(m.pinned_logits, k) : int32_t(argmax(m.pinned_logits, V));
    check_token_ids(m.c, &tok, 1);
  }
  if (on_device) {
    CK(cudaMemcpyAsync(m.pinned_ids, m.mtp->drafted, size_t(n) * 4, cudaMemcpyDeviceToHost, m.stream));
    CK(cudaStreamSynchronize(m.stream));
    std::memcpy(drafted, m.pinned_ids, size_t(n) * 4);
  }
}

}  // namespace flashmoe
