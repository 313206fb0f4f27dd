// Several GPUs behind the runtime interface (backend/cuda/multi_gpu.h
// adapted): --gpus N / --devices LIST. For the runtime's own files
// (device.cpp, bench_support.cpp); the layers above see a Backend.
#pragma once
#include <memory>
#include <vector>

#include "backend/cuda/multi_gpu.h"
#include "core/fifo_mutex.h"
#include "runtime/backend.h"
#include "runtime/device.h"

namespace flashmoe {

class MultiGpuBackend final : public Backend {
 public:
  // `host` may be null for a model built on the devices (bench --synthetic).
  MultiGpuBackend(std::shared_ptr<const QwenModel> host, std::unique_ptr<CudaMultiModel> device);
  ~MultiGpuBackend() override;

  const char* kind() const override { return "cuda"; }
  std::string device_name() const override;
  const ModelConfig& config() const override;
  const QwenModel& model() const override;
  bool has_host_model() const override { return host_ != nullptr; }
  std::unique_ptr<State> new_state(const KvConfig& kv) const override;
  void forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
               ThreadPool& pool) const override;
  void greedy(State& st, int32_t first, int64_t n, int32_t* out, ThreadPool& pool) const override;
  int64_t weight_bytes_total() const override;
  int64_t weight_bytes_per_token() const override;
  std::string expert_stats(int64_t tokens = 0) const override;
  void reset_expert_stats() const override {}

  const CudaMultiModel& device() const { return *device_; }
  CudaMultiModel& device_for_bench() const { return *device_; }
  FifoMutex& call_lock() const { return lock_; }

 private:
  std::shared_ptr<const QwenModel> host_;
  std::unique_ptr<CudaMultiModel> device_;
  mutable FifoMutex lock_;
};

// The GPUs a run asked for (GpuOptions::devices), checked: a build with
// NCCL, GPUs that exist. Empty when the run uses one GPU the plain way.
void check_gpu_list(const GpuOptions& o);
// Uploads `model` to o.devices (expert parallel, experts split evenly).
std::unique_ptr<Backend> make_multi_gpu_backend(std::shared_ptr<const QwenModel> model, const GpuOptions& o);

}  // namespace flashmoe
