// One conversation with a loaded model: the model state plus the tokens fed
// so far. Prefill and decode steps continue the same state.
#pragma once
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "model/qwen_model.h"

namespace flashmoe {

class Session {
 public:
  Session(const QwenModel& model, const KvConfig& kv, ThreadPool& pool);

  // Feeds tokens; returns the next-token logits after the last one.
  const std::vector<float>& feed(const std::vector<int32_t>& ids);
  // Feeds tokens and returns the logits after every one of them ([n, vocab]).
  std::vector<float> feed_all(const std::vector<int32_t>& ids);

  const std::vector<int32_t>& tokens() const { return tokens_; }
  int64_t position() const { return state_.pos; }
  const ModelState& state() const { return state_; }
  ModelState& state() { return state_; }
  const QwenModel& model() const { return model_; }
  const KvConfig& kv_config() const { return kv_; }
  void reset();
  // Replaces the state with a snapshot taken from a session of the same model
  // and KV config, together with the tokens that snapshot has consumed.
  void restore(const ModelState& state, const std::vector<int32_t>& tokens);

 private:
  const QwenModel& model_;
  KvConfig kv_;
  ThreadPool& pool_;
  ModelState state_;
  std::vector<int32_t> tokens_;
  std::vector<float> logits_;
};

int32_t argmax(const float* x, int64_t n);

}  // namespace flashmoe
