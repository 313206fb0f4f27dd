#include "engine/session.h"

#include "core/error.h"

namespace flashmoe {

Session::Session(const QwenModel& model, const KvConfig& kv, ThreadPool& pool)
    : model_(model), kv_(kv), pool_(pool), state_(model.new_state(kv)) {}

void Session::reset() {
  state_ = model_.new_state(kv_);
  tokens_.clear();
}

void Session::restore(const ModelState& state, const std::vector<int32_t>& tokens) {
  if (state.pos != int64_t(tokens.size())) fail("session snapshot: position and token count disagree");
  state_ = state;
  tokens_ = tokens;
}

const std::vector<float>& Session::feed(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  logits_.resize(size_t(model_.config().vocab_size));
  model_.forward(state_, ids.data(), int64_t(ids.size()), LogitsMode::Last, logits_.data(), pool_);
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return logits_;
}

std::vector<float> Session::feed_all(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  std::vector<float> out(ids.size() * size_t(model_.config().vocab_size));
  model_.forward(state_, ids.data(), int64_t(ids.size()), LogitsMode::All, out.data(), pool_);
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return out;
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

}  // namespace flashmoe
