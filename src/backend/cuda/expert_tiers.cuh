// Routed experts tiered for models larger than the GPU (--gpu-expert-cache):
// every expert lives in pinned, device-mapped host memory; a fixed number of
// VRAM slots per layer hold the hottest ones. The expert kernels read each
// expert through a per-layer pointer table, so an expert outside VRAM is
// read straight over the host link (zero-copy) by the same kernels, and the
// decode graph never changes. Choice counts are kept on the device (by the
// top-k); between steps the host snapshots them without blocking and
// promotes experts that have become hotter than a resident one, copying
// them on a second stream while the decode keeps running.
//
// Disk tier (host slots < E): pinned memory holds only `host_slots` experts
// per layer; the others stay in the model's files. Their table entries are
// null until chosen: per MoE layer the decode step hands the chosen ids to
// ensure() (a host round trip), which reads each missing expert through the
// loader into the least recently used host slot and points the table at it
// before the expert kernels run.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "backend/cuda/tier_count.cuh"

namespace flashmoe::cuda {

class ExpertTiers {
 public:
  // layers: MoE layers; E experts each, an expert = gu_bytes + down_bytes;
  // slots: VRAM slots per layer (0 <= slots < E); host_slots: pinned host
  // slots per layer (E: every expert; fewer: the disk tier, set_loader first).
  ExpertTiers(int layers, int E, size_t gu_bytes, size_t down_bytes, int slots, int host_slots);
  ~ExpertTiers();
  ExpertTiers(const ExpertTiers&) = delete;
  ExpertTiers& operator=(const ExpertTiers&) = delete;

  // Pinned host storage of layer l's experts, [host slots] x gu_bytes and
  // [host slots] x down_bytes (expert e in slot e at first): the caller
  // fills them, then calls start().
  uint8_t* host_gu(int l) const { return host_[size_t(l)]; }
  uint8_t* host_down(int l) const { return host_[size_t(l)] + size_t(hslots_) * gu_; }
  int host_slots() const { return hslots_; }
  bool disk() const { return hslots_ < E_; }
  // Disk tier: writes expert e of MoE layer l into gu and down (host memory).
  using Loader = std::function<void(int l, int e, uint8_t* gu, uint8_t* down)>;
  void set_loader(Loader f) { loader_ = std::move(f); }
  // Disk tier, with the step stream idle: every one of ids[0..k) of layer l
  // resident (VRAM or host), the table updated on stream s. The distinct
  // ids must fit the host slots (a decode step's k, a prefill chunk's T * k).
  void ensure(cudaStream_t s, int l, const int* ids, int k);
  // Experts 0..slots-1 of each layer copied to VRAM, pointer tables set.
  void start();

  // Device pointer tables of layer l ([E] entries) and its choice accounting.
  const void* const* gu_tab(int l) const { return d_gu_tab_ + size_t(l) * E_; }
  const void* const* down_tab(int l) const { return d_down_tab_ + size_t(l) * E_; }
  TierCount count(int l) const { return {d_counts_ + size_t(l) * E_, d_tier_ + size_t(l) * E_, d_hits_}; }

  // Between decode steps (or prefill chunks of `tokens` tokens), on the
  // stream the steps run on: completes finished promotions, takes a count
  // snapshot every few tokens, plans new promotions. Never waits for the device.
  void maintain(cudaStream_t main, int tokens = 1);
  // Waits for copies in flight (before the model is destroyed or measured).
  void drain(cudaStream_t main);

  CudaTierStats stats() const;
  void reset_stats();
  size_t vram_bytes() const { return size_t(layers_) * slots_ * (gu_ + down_); }
  size_t host_bytes() const { return size_t(layers_) * hslots_ * (gu_ + down_); }

 private:
  struct Pending {
    int layer, expert, slot;
    cudaEvent_t done;
  };
  void plan(cudaStream_t main);
  void land(cudaStream_t main);  // promotions whose copy is done: tables point at VRAM
  void set(cudaStream_t s, int l, int e, int slot);  // slot -1: host (disk tier: its host slot, or none)
  void host_ptrs(int l, int e, const void** g, const void** d) const;  // device addresses of e's host copy, or null

  int layers_, E_, slots_, hslots_;
  size_t gu_, down_;
  std::vector<uint8_t*> host_;  // per layer, pinned + mapped
  std::vector<uint8_t*> vram_;  // per layer, slots x (gu + down)
  const void** d_gu_tab_ = nullptr;
  const void** d_down_tab_ = nullptr;
  int* d_tier_ = nullptr;
  unsigned* d_counts_ = nullptr;
  unsigned long long* d_hits_ = nullptr;
  std::vector<int> where_;  // [layer][E]: VRAM slot or -1
  std::vector<int> owner_;  // [layer][slot]: expert (resident or arriving)
  std::vector<char> busy_;  // [layer][E]: promotion in flight
  std::vector<double> score_;
  std::vector<unsigned> last_;
  unsigned* h_counts_ = nullptr;  // pinned snapshot
  cudaEvent_t snap_ = nullptr;
  bool snap_pending_ = false;
  int steps_ = 0;
  std::vector<Pending> pending_;
  cudaStream_t copy_ = nullptr;
  uint64_t promotions_ = 0, promoted_bytes_ = 0;
  // Disk tier.
  Loader loader_;
  std::vector<int> hwhere_;             // [layer][E]: host slot or -1
  std::vector<int> howner_;             // [layer][host slot]: expert or -1
  std::vector<uint64_t> hstamp_;        // [layer][host slot]: last use
  uint64_t clock_ = 0, disk_reads_ = 0;
};

}  // namespace flashmoe::cuda
