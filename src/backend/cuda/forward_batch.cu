// CudaModel::forward_batch: one step over several sequences (continuous
// batching). Prompt chunks through forward(); the single tokens of two or
// more sequences through one batched decode step (Prefill::step_batch).
#include <algorithm>
#include <set>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/argmax.h"
#include "core/error.h"

namespace flashmoe {

void CudaModel::forward_batch(const CudaBatchItem* items, int64_t count) const {
  Impl& m = *p_;
  std::set<const CudaState*> seen;
  for (int64_t i = 0; i < count; ++i) {
    if (!items[i].state) fail("forward_batch: item " + std::to_string(i) + " has no state");
    if (!seen.insert(items[i].state).second) fail("forward_batch: one state appears twice in a batch");
    if (items[i].argmax && items[i].mode != LogitsMode::Last)
      fail("forward_batch: item " + std::to_string(i) + " asks for an argmax without LogitsMode::Last");
    check_token_ids(m.c, items[i].ids, items[i].n);
  }
  // One item on its own: a single token wanting only its argmax through the
  // decode step's on-device argmax (one id copied back), else forward()
  // with its logits to the host and the argmax taken there.
  std::vector<float> scratch;
  auto alone = [&](const CudaBatchItem& it) {
    if (it.n == 1 && it.argmax && !it.logits) {
      decode_greedy(*it.state, it.ids[0], 1, it.argmax);
      return;
    }
    float* logits = it.logits;
    if (it.argmax && !logits) {
      scratch.resize(size_t(m.c.vocab_size));
      logits = scratch.data();
    }
    forward(*it.state, it.ids, it.n, it.mode, logits);
    if (it.argmax) *it.argmax = argmax(logits, m.c.vocab_size);
  };
  std::vector<const CudaBatchItem*> single;
  for (int64_t i = 0; i < count; ++i) {
    const CudaBatchItem& it = items[i];
    // A drafting state's token goes alone: forward() keeps its MTP head in step.
    if (it.n == 1 && !it.state->p_->head) single.push_back(&it);
    else alone(it);
  }
  if (single.empty()) return;
  CK(cudaSetDevice(m.dev));
  for (const CudaBatchItem* it : single) m.snapkv_begin_decode(*it->state->p_);  // decoding: snapkv cuts its prompt
  // fp8 `rotated` and Quest states one at a time: the batched step does
  // not rotate their attention output back (rot_gate_kernel) nor choose
  // pages (quest.cuh).
  bool alone_only = false;
  for (const CudaBatchItem* it : single) {
    const std::vector<KvLayer>& kvl = it->state->p_->kvl;
    alone_only = alone_only || (!kvl.empty() && (kvl[0].rot || kvl[0].quest));
  }
  Prefill* pf = single.size() > 1 && !alone_only ? m.batched() : nullptr;
  if (!pf) {  // one sequence (the graph-captured decode step keeps its speed), or no batched path
    for (const CudaBatchItem* it : single) alone(*it);
    return;
  }
  for (size_t g0 = 0; g0 < single.size(); g0 += size_t(pf->max_tokens())) {
    const int B = int(std::min<size_t>(size_t(pf->max_tokens()), single.size() - g0));
    std::vector<PrefillState> seqs(static_cast<size_t>(B));
    std::vector<int32_t> ids(static_cast<size_t>(B));
    std::vector<float*> dst(static_cast<size_t>(B));
    std::vector<int32_t*> best(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      const CudaBatchItem& it = *single[g0 + size_t(b)];
      CudaState::Impl& s = *it.state->p_;
      m.ensure_cap(s, s.pos + 1);
      seqs[size_t(b)] = m.prefill_state(s);
      ids[size_t(b)] = it.ids[0];
      dst[size_t(b)] = it.mode == LogitsMode::None ? nullptr : it.logits;
      best[size_t(b)] = it.argmax;
    }
    pf->step_batch(seqs.data(), B, ids.data());
    for (int b = 0; b < B; ++b) {
      CudaState::Impl& s = *single[g0 + size_t(b)]->state->p_;
      ++s.pos;
    }
    if (m.tiers) m.tiers->maintain(m.stream, B);
    pf->logits_rows(B, dst.data(), best.data());
    CK(cudaStreamSynchronize(m.stream));
  }
}

}  // namespace flashmoe
