// CudaModel::forward_batch: one step over several sequences (continuous
// batching). The prompt chunks of several sequences through one prefill pass
// (Prefill::run_rows; one alone, or one the pass cannot take, through
// forward()); the single tokens of two or more sequences through one
// batched decode step (Prefill::step_batch).
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
  CK(cudaSetDevice(m.dev));
  std::vector<const CudaBatchItem*> single, prompts;
  for (int64_t i = 0; i < count; ++i) {
    const CudaBatchItem& it = items[i];
    // A drafting state's tokens go alone: forward() keeps its MTP head in step.
    if (it.state->p_->head) alone(it);
    else if (it.n == 1) single.push_back(&it);
    else if (m.prompt_rows_fit(*it.state->p_, it.n, it.mode)) prompts.push_back(&it);
    else alone(it);
  }
  // Prompt chunks of several sequences share one prefill pass (each weight
  // and chosen expert read once for all of them), in groups of at most the
  // prefill's rows; a group of one takes forward() as before.
  for (size_t g0 = 0; g0 < prompts.size();) {
    Prefill* pf = m.batched();
    size_t g1 = g0;
    int64_t rows = 0;
    while (g1 < prompts.size() && rows + prompts[g1]->n <= pf->max_tokens()) rows += prompts[g1++]->n;
    if (g1 - g0 == 1) alone(*prompts[g0]);
    else m.prompt_rows(prompts.data() + g0, int(g1 - g0));
    g0 = g1;
  }
  if (single.empty()) return;
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

bool CudaModel::Impl::prompt_rows_fit(CudaState::Impl& s, int64_t n, LogitsMode mode) {
  // Not here: every row's logits (forward() copies them chunk by chunk),
  // snapkv before its cut (its own queries ring), the disk tier (a chunk's
  // experts all resident at once) and several GPUs (not in the pass's
  // tests), attention in order (one sequence per pass).
  if (mode == LogitsMode::All || s.snap || disk || ep) return false;
  Prefill* pf = batched();
  if (!pf || n > pf->max_tokens()) return false;
  for (const KvLayer& kv : s.kvl)
    if (Prefill::in_order(kv, int(s.pos), int(n))) return false;
  return true;
}

void CudaModel::Impl::prompt_rows(const CudaBatchItem* const* its, int S) {
  Prefill& pf = *batched();
  std::vector<PromptRows> seqs(static_cast<size_t>(S));
  std::vector<int32_t> ids;
  std::vector<int> last;  // the rows whose logits or argmax are asked for
  std::vector<float*> dst;
  std::vector<int32_t*> best;
  for (int j = 0; j < S; ++j) {
    const CudaBatchItem& it = *its[j];
    CudaState::Impl& s = *it.state->p_;
    s.verify_n = 0;  // what take_back could return to is gone
    ensure_cap(s, s.pos + it.n);
    PromptRows& r = seqs[size_t(j)];
    r.s = prefill_state(s);
    r.r0 = int(ids.size());
    r.T = int(it.n);
    r.pos = s.pos;
    ids.insert(ids.end(), it.ids, it.ids + it.n);
    if (it.mode == LogitsMode::Last && (it.logits || it.argmax)) {
      last.push_back(r.r0 + r.T - 1);
      dst.push_back(it.logits);
      best.push_back(it.argmax);
    }
  }
  const int R = int(ids.size());
  if (!prompt_ids) prompt_ids = static_cast<int*>(alloc(size_t(pf.max_tokens()) * 4, "prompt rows' ids"));
  CK(cudaMemcpyAsync(prompt_ids, ids.data(), size_t(R) * 4, cudaMemcpyHostToDevice, stream));
  pf.run_rows(seqs.data(), S, prompt_ids);
  for (int j = 0; j < S; ++j) its[j]->state->p_->pos += its[j]->n;
  if (tiers) tiers->maintain(stream, R);
  if (!last.empty()) {
    pf.gather_rows(last.data(), int(last.size()));
    pf.logits_rows(int(last.size()), dst.data(), best.data());
  }
  CK(cudaStreamSynchronize(stream));  // ids (pageable) and the pass's buffers are free again
}

}  // namespace flashmoe
