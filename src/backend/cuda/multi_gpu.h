// Several GPUs of one host running one model by expert parallelism, over
// NCCL (docs/multi-gpu.md). One CudaModel per GPU (rank): every rank holds
// the embedding, attention, GatedDeltaNet, shared expert, router and
// lm_head (replicated) and runs the whole layer sequence on the same
// tokens; each routed expert belongs to one rank
// (experts/expert_partition.h), and a rank's expert tables send the experts
// it does not own to one all-zero expert, whose output adds exactly 0. After
// each MoE layer one ncclAllReduce (sum) of the residual delta gives every
// rank the same hidden state, so everything after it (the next layer, the
// logits, the argmax) stays identical on every rank.
//
// One process, one host thread per rank during a call (rank 0 on the
// caller's), each driving its GPU's stream; communicators from
// ncclCommInitAll. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless
// the environment sets it). Prompts take the batched prefill, whose MoE
// layers all-reduce a chunk's rows the same way.
//
// Plain C++ header: a build without NCCL (or without CUDA) compiles it and
// upload() throws an Error saying so.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_bench.h"
#include "backend/cuda/cuda_model.h"

namespace flashmoe {

// One conversation's state on every rank (each rank's KV caches and
// recurrent states: the ranks compute the same values).
struct CudaMultiState {
  std::vector<std::unique_ptr<CudaState>> ranks;
  int64_t position() const { return ranks.empty() ? 0 : ranks[0]->position(); }
};

class CudaMultiModel {
 public:
  // Whether this build has the multi-GPU path (NCCL found at configure time),
  // and the NCCL version it runs with ("NCCL 2.28.9"; without: why not).
  static bool built_with_nccl();
  static std::string nccl_version();
  // CUDA devices visible to this process (0 without a usable one).
  static int device_count();

  // The model on `devices` (one rank each, rank r on devices[r]); owner:
  // per MoE layer (the plan's moe_slot order), the rank of each routed
  // expert; empty: partition_experts_evenly for every layer. Errors name
  // a device out of range, a tiered expert cache (every routed expert must
  // be in VRAM), a build without NCCL, and NCCL's own failures.
  static std::unique_ptr<CudaMultiModel> upload(const QwenModel& m, const CudaOptions& o,
                                                const std::vector<int>& devices,
                                                const std::vector<std::vector<int>>& owner = {});
  // A synthetic model (cuda_synthetic_model: the same random weights on
  // every rank), experts split evenly.
  static std::unique_ptr<CudaMultiModel> synthetic(const ModelConfig& c, uint64_t seed, const CudaOptions& o,
                                                   const CudaSyntheticOptions& s, const std::vector<int>& devices);
  ~CudaMultiModel();

  int ranks() const;
  const ModelConfig& config() const;
  std::string device_name() const;         // "2 x NVIDIA H200"
  int64_t weight_bytes_total() const;      // over every rank
  int64_t weight_bytes_per_token() const;  // what one token reads on all ranks together (rank 0's count)
  // Rank r's model (benchmark probes: its copy bandwidth).
  const CudaModel& rank_model(int r) const;
  // The rank of each routed expert of MoE layer mi.
  const std::vector<int>& owner(int mi) const;

  std::unique_ptr<CudaMultiState> new_state(const KvConfig& kv) const;
  // Rank 0's state image (every rank holds the same), and a state made from
  // one on every rank.
  CudaStateImage save_state(const CudaMultiState& st) const;
  std::unique_ptr<CudaMultiState> load_state(const CudaStateImage& img) const;
  std::vector<int64_t> kv_positions(const CudaMultiState& st, int layer) const;

  // CudaModel::forward's contract; logits from rank 0.
  void forward(CudaMultiState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits) const;
  // CudaModel::decode_greedy's contract; every rank picks the same ids
  // (checked: a difference is a DeviceError).
  void decode_greedy(CudaMultiState& st, int32_t first, int64_t n, int32_t* out) const;
  void set_use_graph(bool on);

  struct Impl;

 private:
  CudaMultiModel();
  std::unique_ptr<Impl> p_;
};

}  // namespace flashmoe
