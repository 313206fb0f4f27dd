// Routed experts tiered for models larger than the GPU (--gpu-expert-cache):
// a fixed number of VRAM slots per layer hold the hottest experts, the
// others live in pinned, device-mapped host memory, each expert in exactly
// one of the two (so host memory holds only the experts outside VRAM). The expert kernels read each
// expert through a per-layer pointer table, so an expert outside VRAM is
// read straight over the host link (zero-copy) by the same kernels, and the
// decode graph never changes. Choice counts are kept on the device (by the
// top-k); between steps the host snapshots them without blocking and
// promotes experts that have become hotter than a resident one, copying
// them on a second stream while the decode keeps running. A promotion is a
// swap in two copies through a spare VRAM slot (kSwapSpares per layer): the hot expert
// is copied into the spare slot and its table entry moved there, then the
// evicted one is copied into the host slot it left and its entry moved
// there; its old VRAM slot becomes the spare. Every copy waits for the
// steps enqueued before the table change that freed its destination.
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

// Spare VRAM slots per layer for swaps in flight (runtime/memory_plan.h
// reserves as many: kTierSwapSpares).
constexpr int kSwapSpares = kTierSwapSpares;

class ExpertTiers {
 public:
  // layers: MoE layers; E experts each, an expert = gu_bytes + down_bytes;
  // slots: VRAM slots per layer (0 <= slots < E). disk false: the other
  // E - slots experts in pinned host memory (host_slots is ignored); disk
  // true: host_slots pinned host slots per layer (a cache of any experts),
  // the rest read through the loader (set_loader first).
  ExpertTiers(int layers, int E, size_t gu_bytes, size_t down_bytes, int slots, int host_slots, bool disk);
  ~ExpertTiers();
  ExpertTiers(const ExpertTiers&) = delete;
  ExpertTiers& operator=(const ExpertTiers&) = delete;

  // Pinned host storage of layer l's experts, [host slots] x gu_bytes and
  // [host slots] x down_bytes: the caller fills them, then calls start().
  // Without the disk tier expert e >= slots is in host slot e - slots and
  // expert e < slots in VRAM slot e (vram_gu/vram_down: the caller fills
  // those too); with it expert e is in host slot e (e < host slots) and
  // start() copies experts 0..slots-1 to VRAM.
  uint8_t* host_gu(int l) const { return host_[size_t(l)]; }
  uint8_t* host_down(int l) const { return host_[size_t(l)] + size_t(hslots_) * gu_; }
  uint8_t* vram_gu(int l, int slot) const { return vram_[size_t(l)] + size_t(slot) * (gu_ + down_); }
  uint8_t* vram_down(int l, int slot) const { return vram_gu(l, slot) + gu_; }
  int host_slots() const { return hslots_; }
  size_t gu_bytes() const { return gu_; }
  size_t down_bytes() const { return down_; }
  int vram_slots() const { return slots_; }
  bool disk() const { return disk_; }
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

  // Prompts (no disk tier): before MoE layer l's grouped experts over a
  // chunk of T tokens choosing k each, copies every expert of the layer in
  // host memory to a VRAM staging buffer in one transfer on stream s and
  // returns tables reading the layer through it (its VRAM experts as they
  // are): each host expert then crosses the link once per chunk, at copy
  // speed, instead of once per tile of tokens choosing it. Only when the
  // chunk chooses at least E experts (T * k >= E, every expert once on
  // average); else {null, null}: the tables as they are.
  struct Tables {
    const void* const* gu = nullptr;
    const void* const* down = nullptr;
  };
  Tables stage(cudaStream_t s, int l, int T, int k);
  // Bytes of the staging buffer (0: none).
  size_t staging_bytes() const { return stage_ ? size_t(hslots_) * (gu_ + down_) : 0; }

  CudaTierStats stats() const;
  void reset_stats();
  // The VRAM slots include the spare ones (without the disk tier).
  size_t vram_bytes() const { return size_t(layers_) * vram_per_layer_ * (gu_ + down_); }
  size_t host_bytes() const { return size_t(layers_) * hslots_ * (gu_ + down_); }

 private:
  struct Pending {
    int layer, expert, slot;
    cudaEvent_t done;
    // A swap (no disk tier): phase 1 copies `expert` into the spare `slot`,
    // phase 2 copies `evicted` into host slot `host`.
    int phase = 0, evicted = -1, host = -1;
  };
  void plan(cudaStream_t main);
  void plan_swaps(cudaStream_t main);  // plan() without the disk tier
  bool land_swap(cudaStream_t main, Pending& p);  // true when the swap is complete
  void land(cudaStream_t main);  // promotions whose copy is done: tables point at VRAM
  void set(cudaStream_t s, int l, int e, int slot);  // slot -1: host (disk tier: its host slot, or none)
  void host_ptrs(int l, int e, const void** g, const void** d) const;  // device addresses of e's host copy, or null

  int layers_, E_, slots_, hslots_;
  bool disk_;
  int vram_per_layer_;  // slots, plus kSwapSpares without the disk tier
  std::vector<std::vector<int>> spare_;  // [layer]: free VRAM slots (no disk tier), each taken by a swap in flight
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
  // Staging for prompts (no disk tier, more than one MoE layer): one layer's host experts, its tables.
  uint8_t* stage_ = nullptr;
  const void** d_stage_gu_tab_ = nullptr;
  const void** d_stage_down_tab_ = nullptr;
  uint64_t staged_ = 0;  // layers staged
  // Disk tier.
  Loader loader_;
  std::vector<int> hwhere_;             // [layer][E]: host slot or -1
  std::vector<int> howner_;             // [layer][host slot]: expert or -1
  std::vector<uint64_t> hstamp_;        // [layer][host slot]: last use
  uint64_t clock_ = 0, disk_reads_ = 0;
  double pin_seconds_ = 0;  // time cudaHostAlloc took for the host slots
};

}  // namespace flashmoe::cuda
