// One conversation with a loaded model: the model state plus the tokens fed
// so far. Prefill and decode steps continue the same state.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "core/fifo_mutex.h"
#include "core/thread_pool.h"
#include "model/qwen_model.h"

namespace flashmoe {

class Session {
 public:
  // With `cuda`, the forward pass runs on that device (its state lives
  // there); the model must be the one `cuda` was uploaded from. A CudaModel
  // runs one call at a time (one stream, shared scratch buffers): sessions
  // that share it from several threads pass the same `device_mutex`, which
  // every device call of theirs (state creation and release included) holds.
  Session(const QwenModel& model, const KvConfig& kv, ThreadPool& pool, const CudaModel* cuda = nullptr,
          FifoMutex* device_mutex = nullptr);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Feeds tokens; returns the next-token logits after the last one.
  const std::vector<float>& feed(const std::vector<int32_t>& ids);
  // Feeds tokens and returns the logits after every one of them ([n, vocab]).
  std::vector<float> feed_all(const std::vector<int32_t>& ids);

  // Greedy continuation: the argmax after the tokens fed so far, then n-1
  // more, each fed in turn (the last one is not fed). On CUDA without host
  // round trips. Needs at least one token fed before.
  std::vector<int32_t> greedy(int64_t n);

  // Every token fed so far, unless recording is off (then empty).
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Off: fed tokens are not recorded, so a long generation holds no memory
  // per token beyond what the KV cache keeps. Only for a session that is
  // never snapshotted and whose sampling reads no history (no penalties),
  // like `flashmoe run`'s.
  void set_record_tokens(bool on) { record_tokens_ = on; }
  int64_t position() const { return cuda_ ? cstate_->position() : state_.pos; }
  bool on_device() const { return cuda_ != nullptr; }
  const ModelState& state() const { return state_; }
  ModelState& state() { return state_; }
  const QwenModel& model() const { return model_; }
  const KvConfig& kv_config() const { return kv_; }
  // Starts over: an empty state, no tokens. Also done by feed()/feed_all()
  // when the forward pass throws, since a half-run pass leaves the state
  // inconsistent with tokens().
  void reset();
  // Replaces the state with a snapshot taken from a session of the same model
  // and KV config, together with the tokens that snapshot has consumed.
  void restore(const ModelState& state, const std::vector<int32_t>& tokens);
  // The same for a session on the GPU: its state copied to host memory, and
  // back from such a copy.
  CudaStateImage save_device() const;
  void restore(const CudaStateImage& image, const std::vector<int32_t>& tokens);

 private:
  void run_forward(const std::vector<int32_t>& ids, LogitsMode mode, float* out);

  const QwenModel& model_;
  KvConfig kv_;
  ThreadPool& pool_;
  // Holds device_mutex_ (when there is one) for the scope.
  struct DeviceGuard {
    explicit DeviceGuard(FifoMutex* m) : m_(m) {
      if (m_) m_->lock();
    }
    ~DeviceGuard() {
      if (m_) m_->unlock();
    }
    FifoMutex* m_;
  };

  const CudaModel* cuda_;
  FifoMutex* device_mutex_;
  std::unique_ptr<CudaState> cstate_;
  ModelState state_;  // host state (empty when on a device)
  std::vector<int32_t> tokens_;
  bool record_tokens_ = true;
  std::vector<float> logits_;
};

int32_t argmax(const float* x, int64_t n);

}  // namespace flashmoe
