// The CUDA backend class, for the runtime's own files (cuda_backend.cpp and
// bench_support.cpp); everything above the runtime sees it as a Backend.
#pragma once
#include <memory>

#include "backend/cuda/cuda_model.h"
#include "core/fifo_mutex.h"
#include "runtime/backend.h"
#include "runtime/device.h"

namespace flashmoe {

class CudaBackend final : public Backend {
 public:
  // `host` may be null for a model built on the device (bench --synthetic).
  CudaBackend(std::shared_ptr<const QwenModel> host, std::shared_ptr<CudaModel> device);
  ~CudaBackend() override;

  const char* kind() const override { return "cuda"; }
  std::string device_name() const override;
  const ModelConfig& config() const override;
  const QwenModel& model() const override;
  bool has_host_model() const override { return host_ != nullptr; }
  std::unique_ptr<State> new_state(const KvConfig& kv) const override;
  // --mtp: the MTP head on the device (backend/cuda/mtp.cu).
  std::unique_ptr<State> new_drafting_state(const KvConfig& kv) const override;
  void draft(State& st, int32_t next, int64_t n, const DraftPicker& pick, int32_t* drafted,
             ThreadPool& pool) const override;
  void forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
               ThreadPool& pool) const override;
  // The decode tokens of several sequences in one batched step (CudaModel::forward_batch).
  void forward_batch(const BatchItem* items, int64_t count, ThreadPool& pool) const override;
  void greedy(State& st, int32_t first, int64_t n, int32_t* out, ThreadPool& pool) const override;
  // A drafting state's verify pass picks each row's argmax on the device (CudaModel::forward_argmax_rows).
  void forward_argmax_rows(State& st, const int32_t* ids, int64_t n, int32_t* best, ThreadPool& pool) const override;
  int64_t weight_bytes_total() const override;
  int64_t weight_bytes_per_token() const override;
  std::string expert_stats(int64_t tokens = 0) const override;
  ExpertTierStats tier_stats() const override;
  void reset_expert_stats() const override;

  const CudaModel& device() const { return *device_; }
  FifoMutex& call_lock() const { return lock_; }

  // Conversation snapshots (State::snapshot) are kept in VRAM up to this
  // many bytes in all (default: an eighth of the GPU's memory, and only
  // while 8 GiB stay free beside them); past it the least recently used
  // move to host memory, and one larger than the whole budget is taken to
  // host memory directly. Like states, snapshots must not outlive their
  // backend.
  void set_snapshot_vram_budget(size_t bytes);
  size_t snapshot_vram_budget() const;
  size_t snapshot_vram_bytes() const;  // held by snapshots in VRAM now
  struct SnapshotVram;                 // cuda_backend.cpp; guarded by the call lock
  SnapshotVram& snapshot_vram() const { return *snap_vram_; }
  // The benchmark's direct access (graph switch, probes, per-kernel profile).
  CudaModel& device_for_bench() const;
  static CudaState& device_state_for_bench(State& st);

 private:
  std::shared_ptr<const QwenModel> host_;
  std::shared_ptr<CudaModel> device_;
  mutable FifoMutex lock_;
  std::unique_ptr<SnapshotVram> snap_vram_;
};

struct ModelFootprint;
// The CUDA backend's options for a run's GPU options; with a footprint, the
// memory plan decided (and printed under show_plan) before the upload.
CudaOptions cuda_options(const GpuOptions& o, const ModelFootprint* f = nullptr);

// "gpu expert cache: 12 of 64 experts per layer in VRAM (...), ..." for --stats.
std::string format_tier_stats(const ExpertTierStats& s, int64_t tokens = 0);

}  // namespace flashmoe
