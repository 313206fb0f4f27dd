#include "engine/session.h"

#include "core/error.h"

namespace flashmoe {

Session::Session(const QwenModel& model, const KvConfig& kv, ThreadPool& pool, const CudaModel* cuda)
    : model_(model), kv_(kv), pool_(pool), cuda_(cuda) {
  if (cuda_) cstate_ = cuda_->new_state(kv);
  else state_ = model.new_state(kv);
}

void Session::reset() {
  if (cuda_) cstate_ = cuda_->new_state(kv_);
  else state_ = model_.new_state(kv_);
  tokens_.clear();
}

std::vector<int32_t> Session::greedy(int64_t n) {
  std::vector<int32_t> out;
  if (n <= 0) return out;
  if (position() == 0) fail("greedy: feed a prompt first");
  const int64_t V = model_.config().vocab_size;
  if (logits_.size() != size_t(V)) fail("greedy: no logits of the last token (feed with feed(), not feed_all())");
  out.push_back(argmax(logits_.data(), V));
  if (n == 1) return out;
  if (cuda_) {
    out.resize(size_t(n));
    cuda_->decode_greedy(*cstate_, out[0], n - 1, out.data() + 1);
    if (record_tokens_) tokens_.insert(tokens_.end(), out.begin(), out.end() - 1);
    return out;
  }
  for (int64_t i = 1; i < n; ++i) out.push_back(argmax(feed({out.back()}).data(), V));
  return out;
}

void Session::restore(const ModelState& state, const std::vector<int32_t>& tokens) {
  if (cuda_) fail("conversation snapshots are kept on the host: not available with --device cuda");
  if (state.pos != int64_t(tokens.size())) fail("session snapshot: position and token count disagree");
  state_ = state;
  tokens_ = tokens;
}

const std::vector<float>& Session::feed(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  logits_.resize(size_t(model_.config().vocab_size));
  if (cuda_) cuda_->forward(*cstate_, ids.data(), int64_t(ids.size()), LogitsMode::Last, logits_.data());
  else model_.forward(state_, ids.data(), int64_t(ids.size()), LogitsMode::Last, logits_.data(), pool_);
  if (record_tokens_) tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return logits_;
}

std::vector<float> Session::feed_all(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  std::vector<float> out(ids.size() * size_t(model_.config().vocab_size));
  if (cuda_) cuda_->forward(*cstate_, ids.data(), int64_t(ids.size()), LogitsMode::All, out.data());
  else model_.forward(state_, ids.data(), int64_t(ids.size()), LogitsMode::All, out.data(), pool_);
  const size_t V = size_t(model_.config().vocab_size);
  logits_.assign(out.end() - V, out.end());
  if (record_tokens_) tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return out;
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

}  // namespace flashmoe
