#include "engine/session.h"

#include "backend/cpu/forward.h"
#include "core/error.h"

namespace flashmoe {

Session::Session(const QwenModel& model, const KvConfig& kv, ThreadPool& pool, const CudaModel* cuda,
                 FifoMutex* device_mutex)
    : model_(model), kv_(kv), pool_(pool), cuda_(cuda), device_mutex_(cuda ? device_mutex : nullptr) {
  if (cuda_) {
    DeviceGuard g(device_mutex_);
    cstate_ = cuda_->new_state(kv);
  } else {
    state_ = model.new_state(kv);
  }
}

Session::~Session() {
  DeviceGuard g(device_mutex_);  // freeing device memory is a device call too
  cstate_.reset();
}

void Session::reset() {
  if (cuda_) {
    DeviceGuard g(device_mutex_);
    cstate_.reset();  // before the new one: the device need not hold both
    cstate_ = cuda_->new_state(kv_);
  } else {
    state_ = model_.new_state(kv_);
  }
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
    try {
      DeviceGuard g(device_mutex_);
      cuda_->decode_greedy(*cstate_, out[0], n - 1, out.data() + 1);
    } catch (...) {
      reset();  // the device state is part-way through the run (see run_forward)
      throw;
    }
    if (record_tokens_) tokens_.insert(tokens_.end(), out.begin(), out.end() - 1);
    return out;
  }
  for (int64_t i = 1; i < n; ++i) out.push_back(argmax(feed({out.back()}).data(), V));
  return out;
}

CudaStateImage Session::save_device() const {
  if (!cuda_) fail("session snapshot: this session is not on a GPU");
  DeviceGuard g(device_mutex_);
  return cuda_->save_state(*cstate_);
}

void Session::restore(const CudaStateImage& image, const std::vector<int32_t>& tokens) {
  if (!cuda_) fail("session snapshot: a GPU state cannot be restored into a CPU session");
  if (image.pos != int64_t(tokens.size())) fail("session snapshot: position and token count disagree");
  if (image.kv.describe() != kv_.describe()) fail("session snapshot: taken with another KV configuration");
  DeviceGuard g(device_mutex_);
  cstate_.reset();  // before the new one: the device need not hold both
  cstate_ = cuda_->load_state(image);
  tokens_ = tokens;
}

void Session::restore(const ModelState& state, const std::vector<int32_t>& tokens) {
  if (cuda_) fail("session snapshot: a CPU state cannot be restored into a GPU session");
  if (state.pos != int64_t(tokens.size())) fail("session snapshot: position and token count disagree");
  state_ = state;
  tokens_ = tokens;
}

// A forward pass that fails part-way (an expert file that cannot be read, a
// failing device) has already advanced the state of the layers before the
// failure, while tokens_ still says it holds only what came before. Reusing
// that state would continue from a corrupted context and produce plausible
// but wrong text, so the session starts over instead: the next feed reads
// the conversation again from the start.
void Session::run_forward(const std::vector<int32_t>& ids, LogitsMode mode, float* out) {
  try {
    if (cuda_) {
      DeviceGuard g(device_mutex_);
      cuda_->forward(*cstate_, ids.data(), int64_t(ids.size()), mode, out);
    } else {
      cpu::forward(model_, state_, ids.data(), int64_t(ids.size()), mode, out, pool_);
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
  logits_.resize(size_t(model_.config().vocab_size));
  run_forward(ids, LogitsMode::Last, logits_.data());
  if (record_tokens_) tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return logits_;
}

std::vector<float> Session::feed_all(const std::vector<int32_t>& ids) {
  if (ids.empty()) fail("nothing to feed: the token list is empty");
  std::vector<float> out(ids.size() * size_t(model_.config().vocab_size));
  run_forward(ids, LogitsMode::All, out.data());
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
