// The CPU backend behind the runtime interface: the forward pass of
// backend/cpu over a host model, states in host memory (ModelState).
#pragma once
#include <memory>

#include "runtime/backend.h"

namespace flashmoe {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(std::shared_ptr<const QwenModel> model);

  const char* kind() const override { return "cpu"; }
  std::string device_name() const override { return "cpu"; }
  const ModelConfig& config() const override;
  const QwenModel& model() const override { return *model_; }
  std::unique_ptr<State> new_state(const KvConfig& kv) const override;
  void forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
               ThreadPool& pool) const override;
  // One step over all items: their rows stacked, so each weight and each
  // picked expert is read once per step (backend/cpu/forward.h).
  void forward_batch(const BatchItem* items, int64_t count, ThreadPool& pool) const override;
  void greedy(State& st, int32_t first, int64_t n, int32_t* out, ThreadPool& pool) const override;
  std::unique_ptr<State> new_drafting_state(const KvConfig& kv) const override;
  void draft(State& st, int32_t next, int64_t n, const DraftPicker& pick, int32_t* drafted,
             ThreadPool& pool) const override;
  int64_t weight_bytes_total() const override;
  int64_t weight_bytes_per_token() const override;
  std::string expert_stats(int64_t tokens = 0) const override;
  void reset_expert_stats() const override;

  void forward_capturing(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                         ThreadPool& pool, std::vector<std::vector<float>>* hidden) const override;

 private:
  std::shared_ptr<const QwenModel> model_;
};

}  // namespace flashmoe
