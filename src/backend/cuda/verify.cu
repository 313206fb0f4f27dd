// The verify pass of speculative decoding on the GPU (--mtp): a drafting
// state's few tokens through the batched decode step with rows of one
// sequence (Prefill::step_batch's VerifyRows), so each weight and each
// chosen expert is read once for all the rows, in a graph captured per row
// count; the recurrent states after every row are kept, so a rejected draft
// rolls back by one copy kernel (take_back) instead of a restore point and
// a second pass over the kept tokens.
#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/argmax.h"
#include "core/error.h"

namespace flashmoe {

namespace {

// One copy of take_back: n floats from src to dst.
struct RowCopy {
  float* dst;
  const float* src;
  size_t n;
};

// blockIdx.y: the copy; the blocks along x stride over its floats.
__global__ void row_copies_kernel(const RowCopy* jobs) {
  const RowCopy j = jobs[blockIdx.y];
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < j.n; i += size_t(gridDim.x) * blockDim.x)
    j.dst[i] = j.src[i];
}

}  // namespace

bool CudaModel::Impl::verify_fits(CudaState::Impl& s, int64_t n) {
  if (!s.head || n < 2 || n > kVerifyRows) return false;
  // A ring (window, streaming, snapkv's cut) would let a later row's K/V
  // overwrite a position an earlier row still reads; h2o moves slots; the
  // batched step does not rotate fp8 `rotated` outputs back; the disk tier
  // and several GPUs are not in the batched step's graph.
  if (s.window > 0 || s.h2o || s.snap || disk || ep) return false;
  // quest: its page choice is one per sequence, made for one query.
  if (!s.kvl.empty() && (s.kvl[0].rot || s.kvl[0].quest)) return false;
  const int64_t dk = c.lin_k_dim, dv = c.lin_v_dim;  // delta_cluster_verify_kernel's shapes
  if (!(dv % 32 == 0 && dv / 32 <= 8 && (dk == 128 || dk == 64 || dk == 32))) return false;
  Prefill* pf = batched();
  return pf && pf->max_tokens() >= n;
}

void CudaModel::Impl::keep_verify_rows(CudaState::Impl& s) {
  if (!s.verify_jobs) {
    const size_t conv_n = size_t(c.lin_conv_dim() * (c.conv_kernel - 1));
    const size_t ssm_n = size_t(c.lin_num_v_heads * c.lin_k_dim * c.lin_v_dim);
    const int H = int(c.hidden_size), R = kVerifyRows - 1;  // rows whose states are kept
    for (size_t l = 0; l < s.conv.size(); ++l) {
      s.conv_rows.push_back(static_cast<float*>(dev_alloc(conv_n * R * 4, "verify pass: conv states")));
      s.ssm_rows.push_back(static_cast<float*>(dev_alloc(ssm_n * R * 4, "verify pass: delta-rule states")));
    }
    s.head_rows = static_cast<float*>(dev_alloc(size_t(kVerifyRows) * H * 4, "verify pass: MTP hidden states"));
    // take_back's copies for each row it can return to, written once.
    std::vector<RowCopy> jobs;
    for (int k = 0; k < R; ++k) {
      for (size_t l = 0; l < s.conv.size(); ++l) {
        jobs.push_back({s.conv[l], s.conv_rows[l] + size_t(k) * conv_n, conv_n});
        jobs.push_back({s.ssm[l], s.ssm_rows[l] + size_t(k) * ssm_n, ssm_n});
      }
      jobs.push_back({s.head_hidden, s.head_rows + size_t(k) * H, size_t(H)});
    }
    s.verify_jobs = dev_alloc(jobs.size() * sizeof(RowCopy), "verify pass: roll-back copies");
    CK(cudaMemcpy(s.verify_jobs, jobs.data(), jobs.size() * sizeof(RowCopy), cudaMemcpyHostToDevice));
  }
}

void CudaModel::Impl::verify(CudaState::Impl& s, const int32_t* ids, int64_t n, LogitsMode mode, float* out,
                             int32_t* best) {
  Prefill& pf = *batched();
  const int64_t V = c.vocab_size, p0 = s.pos;
  const int H = int(c.hidden_size);
  ensure_cap(s, p0 + n);
  ensure_cap(*s.head, p0 + n);
  keep_verify_rows(s);
  const size_t scores_row = size_t(s.cap) * size_t(std::max(s.nh, 1));
  if (s.verify_scores_cap < s.cap) {  // the cache grew (ensure_cap): the rows' scratch with it
    cudaFree(s.verify_scores);
    s.verify_scores = static_cast<float*>(dev_alloc(scores_row * kVerifyRows * 4, "verify pass: attention scores"));
    s.verify_scores_cap = s.cap;
  }
  put_ids(s, ids, n);  // the head's tokens (device ring)
  const PrefillState ps = prefill_state(s);
  const VerifyRows rows{p0, &s.conv_rows, &s.ssm_rows, s.verify_scores, scores_row};
  pf.step_batch(&ps, int(n), ids, &rows);
  s.pos += n;
  if (tiers) tiers->maintain(stream, int(n));
  for (int t = 0; t < int(n); ++t) {  // the head's entries of the rows, its hidden state after each kept
    advance_head(s, s.d_ids + t, p0 + t, pf.hidden(t));
    CK(cudaMemcpyAsync(s.head_rows + size_t(t) * H, s.head_hidden, size_t(H) * 4, cudaMemcpyDeviceToDevice, stream));
  }
  std::vector<float*> dst(size_t(n), nullptr);
  std::vector<int32_t*> arg(size_t(n), nullptr);
  for (int64_t t = 0; t < n; ++t) {
    if (mode == LogitsMode::All || (mode == LogitsMode::Last && t == n - 1))
      dst[size_t(t)] = mode == LogitsMode::All ? out + t * V : out;
    if (best) arg[size_t(t)] = best + t;
  }
  pf.logits_rows(int(n), dst.data(), arg.data());
  CK(cudaStreamSynchronize(stream));  // (logits_rows has unless nothing was asked) before pinned_ids is reused
  s.verify_p0 = p0;
  s.verify_n = int(n);
}

void CudaModel::forward_argmax_rows(CudaState& st, const int32_t* ids, int64_t n, int32_t* best) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  check_token_ids(m.c, ids, n);
  CK(cudaSetDevice(m.dev));
  s.verify_n = 0;
  if (m.verify_fits(s, n)) {
    m.verify(s, ids, n, LogitsMode::None, nullptr, best);
    return;
  }
  const int64_t V = m.c.vocab_size;
  std::vector<float> rows(size_t(std::max<int64_t>(n, 0) * V));
  forward(st, ids, n, LogitsMode::All, rows.data());
  for (int64_t t = 0; t < n; ++t) best[t] = argmax(rows.data() + t * V, V);
}

bool CudaModel::keeps_rows(CudaState& st, int64_t n) const { return p_->verify_fits(*st.p_, n); }

bool CudaModel::take_back(CudaState& st, int64_t position) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  if (s.verify_n == 0 || s.pos != s.verify_p0 + s.verify_n || position <= s.verify_p0 || position > s.pos)
    return false;
  CK(cudaSetDevice(m.dev));
  const int k = int(position - s.verify_p0 - 1);  // the last row kept
  if (k + 1 < s.verify_n) {
    const int per_row = int(2 * s.conv.size() + 1);
    const RowCopy* jobs = static_cast<const RowCopy*>(s.verify_jobs) + size_t(k) * per_row;
    row_copies_kernel<<<dim3(64, unsigned(per_row)), 256, 0, m.stream>>>(jobs);
    CK(cudaGetLastError());
  }
  s.pos = position;
  m.pinned_ids[0] = int32_t(position);
  CK(cudaMemcpyAsync(s.d_pos, m.pinned_ids, 4, cudaMemcpyHostToDevice, m.stream));
  CK(cudaStreamSynchronize(m.stream));  // before pinned_ids is written again
  s.head->pos = position - 1;
  s.verify_n = 0;
  return true;
}

}  // namespace flashmoe
