// The forward pass: prompts of several tokens through the batched prefill
// (prefill.cuh) in chunks, single tokens and greedy decoding through the
// decode step (graph.cu).
#include <algorithm>
#include <cstring>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/error.h"
#include "model/plan.h"

namespace flashmoe {

// The batched prefill, made at its first use; null where it cannot run
// (switched off, shapes it does not cover, no device memory left for its
// buffers): token by token then.
Prefill* CudaModel::Impl::batched() {
  if (prefill_tried) return prefill.get();
  prefill_tried = true;
  if (!opts.decode.batched_prefill) return nullptr;
  PrefillModel pm;
  pm.c = &c;
  pm.L = &L;
  pm.plan = &plan;
  pm.embed = embed;
  pm.lm_head = lm_head;
  pm.final_norm = final_norm;
  pm.inv_freq = inv_freq;
  pm.stream = stream;
  pm.profile = opts.decode.prefill_profile;
  pm.batch_graph = opts.decode.batch_graph;
  pm.batch_experts = int(opts.decode.batch_experts);
  if (ep) {  // expert parallel: the all-reduce after each MoE's experts (multi_gpu.cu)
    pm.moe_before = [this](float* rows, int T) { ep_before_rows(rows, T); };
    pm.moe_after = [this](float* rows, int T) { ep_after_rows(rows, T); };
  }
  int max_t = chunk;
  if (tiers && !disk)
    pm.stage_experts = [this](int mi, int T) {
      const ExpertTiers::Tables t = tiers->stage(stream, mi, T, int(c.num_experts_per_tok));
      return std::make_pair(t.gu, t.down);
    };
  if (disk) {
    // Every expert a chunk chooses must be resident at once (host or
    // VRAM): at most T * k distinct ones, so T <= host slots / k.
    pm.experts_needed = [this](int mi, const int* d_ids, int n) { fetch_experts(mi, d_ids, n); };
    max_t = std::min(chunk, std::max(1, tiers->host_slots() / int(c.num_experts_per_tok)));
    // Chunks of 1-2 tokens lose to the decode step, chunks of 3 win (d2 in
    // bench/NOTES-cuda.md).
    if (max_t < 3) return nullptr;
  }
  if (!Prefill::unsupported(pm).empty()) return nullptr;
  // Its buffers grow with the chunk (~0.6 GB at 2048 tokens for the 35B):
  // where the device has no room, shorter chunks.
  for (int t = max_t; !prefill && t >= std::min(max_t, 64); t /= 2) {
    try {
      prefill = std::make_unique<Prefill>(pm, t);
    } catch (const Error&) {
      prefill.reset();
    }
  }
  return prefill.get();
}

// Puts ids[0..n) into the device ring at positions pos.. (base = pos).
void CudaModel::Impl::put_ids(CudaState::Impl& s, const int32_t* ids, int64_t n) {
  std::memcpy(pinned_ids, ids, size_t(n) * 4);
  pinned_ids[n] = int32_t(s.pos);  // base, copied separately below
  CK(cudaMemcpyAsync(s.d_ids, pinned_ids, size_t(n) * 4, cudaMemcpyHostToDevice, stream));
  CK(cudaMemcpyAsync(s.d_base, pinned_ids + n, 4, cudaMemcpyHostToDevice, stream));
}

PrefillState CudaModel::Impl::prefill_state(CudaState::Impl& s) const {
  PrefillState ps;
  ps.kvl = &s.kvl;
  ps.conv = &s.conv;
  ps.ssm = &s.ssm;
  ps.kvt = s.kvt;
  ps.ns = s.ns;
  ps.el = s.el;
  ps.d_pos = s.d_pos;
  ps.scores = s.scores;
  ps.attn_split = attn_blocks(attn_positions(s), s.hd);
  return ps;
}

void CudaModel::forward(CudaState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  const int64_t V = m.c.vocab_size;
  check_token_ids(m.c, ids, n);
  CK(cudaSetDevice(m.dev));
  s.verify_n = 0;  // what take_back could return to is gone
  if (m.verify_fits(s, n)) {
    m.verify(s, ids, n, mode, logits, nullptr);
    return;
  }
  // A single-token step is decoding: snapkv cuts the prompt now (as the CPU).
  if (n == 1) m.snapkv_begin_decode(s);
  m.ensure_cap(s, s.pos + n);
  // After the cut, tokens go one at a time (the kept prompt positions are
  // not a prefix for the batched prefill's attention), as on the CPU.
  Prefill* pf = n > 1 && !s.snap_done ? m.batched() : nullptr;
  if (s.snap && !s.snap_done && n > 1 && !pf)
    fail_device(DeviceFailure::Unsupported,
                "CUDA backend: --kv-snapkv needs the batched prefill (it keeps the prompt's last queries), which is "
                "off or cannot run this model");
  if (s.head) m.ensure_cap(*s.head, s.pos + n);
  for (int64_t b = 0; b < n; b += kRing - 1) {
    const int64_t len = std::min<int64_t>(kRing - 1, n - b);
    m.put_ids(s, ids + b, len);
    if (pf) {
      PrefillState ps = m.prefill_state(s);
      if (s.snap) ps.snap_q = s.snap_q.data();
      for (int64_t c0 = 0; c0 < len; c0 += pf->max_tokens()) {
        const int T = int(std::min<int64_t>(pf->max_tokens(), len - c0));
        const int64_t p0 = s.pos;
        pf->run(ps, s.d_ids + c0, T, s.pos);
        s.pos += T;
        if (m.tiers) m.tiers->maintain(m.stream, T);
        const int64_t g0 = b + c0;
        if (mode == LogitsMode::All) {
          pf->logits(0, T, logits + g0 * V);
        } else if (mode == LogitsMode::Last && g0 + T == n) {
          CK(cudaMemcpyAsync(m.x, pf->hidden(T - 1), size_t(m.c.hidden_size) * 4, cudaMemcpyDeviceToDevice, m.stream));
          m.pdl_next = false;
          m.matvec(m.lm_head, m.x, m.final_norm, m.logits, 0, K_LMHEAD);
          CK(cudaMemcpyAsync(m.pinned_logits, m.logits, size_t(V) * 4, cudaMemcpyDeviceToHost, m.stream));
          CK(cudaStreamSynchronize(m.stream));
          std::memcpy(logits, m.pinned_logits, size_t(V) * 4);
        }
        if (s.head)  // the MTP head's entries of the chunk's tokens, one at a time
          for (int t = 0; t < T; ++t) m.advance_head(s, s.d_ids + c0 + t, p0 + t, pf->hidden(t));
      }
      CK(cudaStreamSynchronize(m.stream));
      continue;
    }
    for (int64_t t = 0; t < len; ++t) {
      const int64_t g = b + t;
      const bool want = mode == LogitsMode::All || (mode == LogitsMode::Last && g == n - 1);
      m.run_step(s, want ? 1 : 0);
      if (s.head) m.advance_head(s, s.d_ids + t, s.pos, m.x);  // leaves the logits alone
      ++s.pos;
      if (m.tiers) m.tiers->maintain(m.stream);
      if (want) {
        CK(cudaMemcpyAsync(m.pinned_logits, m.logits, size_t(V) * 4, cudaMemcpyDeviceToHost, m.stream));
        CK(cudaStreamSynchronize(m.stream));
        std::memcpy(mode == LogitsMode::All ? logits + g * V : logits, m.pinned_logits, size_t(V) * 4);
      }
    }
    CK(cudaStreamSynchronize(m.stream));
  }
}

void CudaModel::decode_greedy(CudaState& st, int32_t first, int64_t n, int32_t* out) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  check_token_ids(m.c, &first, 1);
  CK(cudaSetDevice(m.dev));
  s.verify_n = 0;
  m.snapkv_begin_decode(s);
  m.ensure_cap(s, s.pos + n);
  if (s.head) m.ensure_cap(*s.head, s.pos + n);
  int32_t next = first;
  for (int64_t b = 0; b < n; b += kRing - 2) {
    const int64_t len = std::min<int64_t>(kRing - 2, n - b);
    m.put_ids(s, &next, 1);
    CK(cudaMemsetAsync(s.d_step, 0, 4, m.stream));
    for (int64_t t = 0; t < len; ++t) {
      m.run_step(s, 2);
      if (s.head) m.advance_head(s, s.d_ids + t, s.pos, m.x);  // the token this step fed: ring entry t
      ++s.pos;
      if (m.tiers) m.tiers->maintain(m.stream);
    }
    CK(cudaMemcpyAsync(m.pinned_ids, s.d_out, size_t(len) * 4, cudaMemcpyDeviceToHost, m.stream));
    CK(cudaStreamSynchronize(m.stream));
    std::memcpy(out + b, m.pinned_ids, size_t(len) * 4);
    next = out[b + len - 1];
  }
}

}  // namespace flashmoe
