#include "engine/session.h"

#include <algorithm>

#include "core/error.h"

namespace flashmoe {

Session::Session(const Backend& backend, const KvConfig& kv, ThreadPool& pool, bool drafting)
    : backend_(backend),
      kv_(kv),
      pool_(&pool),
      state_(drafting ? backend.new_drafting_state(kv) : backend.new_state(kv)),
      drafting_(drafting) {}

Session::Session(BatchScheduler& scheduler, const KvConfig& kv, bool drafting)
    : backend_(scheduler.backend()),
      kv_(kv),
      scheduler_(&scheduler),
      state_(drafting ? backend_.new_drafting_state(kv) : backend_.new_state(kv)),
      drafting_(drafting) {
  // Drafting runs the MTP head outside the scheduler's steps, on this
  // session's own thread (the head is one layer: cheap next to a step).
  if (drafting) draft_pool_ = std::make_unique<ThreadPool>(1);
  membership_.emplace(scheduler);
}

void Session::reset() {
  state_.reset();  // before the new one: a device need not hold both
  state_ = drafting_ ? backend_.new_drafting_state(kv_) : backend_.new_state(kv_);
  tokens_.clear();
}

std::vector<int32_t> Session::draft(int32_t next, int64_t n, const DraftPicker& pick) {
  std::vector<int32_t> out(size_t(std::max<int64_t>(n, 0)));
  if (n > 0) backend_.draft(*state_, next, n, pick, out.data(), pool_ ? *pool_ : *draft_pool_);
  return out;
}

std::vector<int32_t> Session::greedy(int64_t n) {
  std::vector<int32_t> out;
  if (n <= 0) return out;
  if (position() == 0) fail("greedy: feed a prompt first");
  const int64_t V = backend_.config().vocab_size;
  if (logits_.size() != size_t(V)) fail("greedy: no logits of the last token (feed with feed(), not feed_all() or feed_argmax())");
  out.push_back(argmax(logits_.data(), V));
  if (n == 1) return out;
  out.resize(size_t(n));
  if (scheduler_) {  // token by token through the shared steps (feed records what it feeds)
    for (int64_t i = 1; i < n; ++i) out[size_t(i)] = argmax(feed({out[size_t(i - 1)]}).data(), V);
    return out;
  }
  try {
    backend_.greedy(*state_, out[0], n - 1, out.data() + 1, *pool_);
  } catch (...) {
    reset();  // the state is part-way through the run (see run_forward)
    throw;
  }
  if (record_tokens_) tokens_.insert(tokens_.end(), out.begin(), out.end() - 1);
  return out;
}

SessionSnapshot Session::snapshot() const { return {tokens_, state_->snapshot()}; }
SessionSnapshot Session::rollback_point() { return {tokens_, state_->rollback_point()}; }

bool Session::take_back(int64_t position) {
  if (!state_->take_back(position)) return false;
  if (record_tokens_) tokens_.resize(size_t(position));
  return true;
}

void Session::restore(const SessionSnapshot& snap) {
  if (record_tokens_ && snap.state->position() != int64_t(snap.tokens.size()))
    fail("session snapshot: position and token count disagree");
  state_->restore(*snap.state);
  tokens_ = snap.tokens;
}

// A forward pass that fails part-way (an expert file that cannot be read, a
// failing device) has already advanced the state of the layers before the
// failure, while tokens_ still says it holds only what came before. Reusing
// that state would continue from a corrupted context and produce plausible
// but wrong text, so the session starts over instead: the next feed reads
// the conversation again from the start.
void Session::run_forward(const std::vector<int32_t>& ids, LogitsMode mode, float* out, int32_t* argmax) {
  try {
    if (scheduler_) {
      if (!membership_) fail("this session has left the batch (Session::leave_batch)");
      scheduler_->forward(*state_, ids.data(), int64_t(ids.size()), mode, out, argmax, &cancel_);
    } else if (argmax) {
      const BatchItem it{state_.get(), ids.data(), int64_t(ids.size()), mode, out, argmax};
      backend_.forward_batch(&it, 1, *pool_);
    } else {
      backend_.forward(*state_, ids.data(), int64_t(ids.size()), mode, out, *pool_);
    }
  } catch (...) {
    try {
      reset();
    } catch (...) {
    }
    throw;
  }
}

const std::vector<float>& Session::feed(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  logits_.resize(size_t(backend_.config().vocab_size));
  run_forward(ids, LogitsMode::Last, logits_.data());
  if (record_tokens_) tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return logits_;
}

int32_t Session::feed_argmax(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  logits_.clear();
  int32_t best = 0;
  run_forward(ids, LogitsMode::Last, nullptr, &best);
  if (record_tokens_) tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return best;
}

std::vector<int32_t> Session::feed_argmax_rows(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  std::vector<int32_t> best(ids.size());
  if (scheduler_) {  // the shared steps take logits
    const std::vector<float> rows = feed_all(ids);
    const int64_t V = backend_.config().vocab_size;
    for (size_t t = 0; t < ids.size(); ++t) best[t] = argmax(rows.data() + t * size_t(V), V);
  } else {
    try {
      backend_.forward_argmax_rows(*state_, ids.data(), int64_t(ids.size()), best.data(), *pool_);
    } catch (...) {
      reset();  // as run_forward
      throw;
    }
    if (record_tokens_) tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  }
  logits_.clear();
  return best;
}

std::vector<float> Session::feed_all(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  const size_t V = size_t(backend_.config().vocab_size);
  std::vector<float> out(ids.size() * V);
  run_forward(ids, LogitsMode::All, out.data());
  logits_.assign(out.end() - V, out.end());
  if (record_tokens_) tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return out;
}

}  // namespace flashmoe
