// The CUDA backend: a QwenModel's weights uploaded to one GPU and the whole
// forward pass run there (embedding to lm_head), with the per-session state
// (KV caches, conv and delta-rule states) in device memory. Routing is
// decided on the device, so a decode step needs no host round trip; each
// step is captured once in a CUDA graph and replayed. A prompt of several
// tokens goes through the batched prefill instead (prefill.cuh: layer by
// layer over chunks of up to 2048 tokens).
//
// Plain C++ header (no CUDA headers): builds without CUDA, where every entry
// point throws Error("this build has no CUDA backend").
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/decode_options.h"
#include "format/config.h"
#include "kv/kv_config.h"
#include "model/qwen_model.h"

namespace flashmoe {

struct CudaModelAccess;

// One conversation's device state. Created by CudaModel::new_state.
class CudaState {
 public:
  ~CudaState();
  int64_t position() const;
  struct Impl;
  std::unique_ptr<Impl> p_;
};

// Spare VRAM slots per MoE layer the tiered cache keeps for promotions in
// flight (swaps through them), beside its slots: a plan reserves them.
constexpr int kTierSwapSpares = 2;

// Where the routed experts live on the GPU (--gpu-expert-cache).
struct CudaOptions {
  // VRAM for routed experts: a size in GB (expert_cache_gb >= 0) or a
  // fraction of all expert bytes (expert_cache_fraction >= 0); neither: all
  // experts in VRAM. What does not fit stays in pinned host memory, read
  // over the host link by the expert kernels and promoted to VRAM when hot.
  double expert_cache_gb = -1;
  double expert_cache_fraction = -1;
  // Pinned host memory for the routed experts outside VRAM (with a VRAM
  // cache above): GB or a fraction of all expert bytes; neither: all of
  // them. Experts in neither tier are read through the model's expert store
  // (its packed files) when chosen: the decode step waits for the host at
  // every MoE layer, and prompts go in chunks of host slots / top-k tokens
  // (every expert a chunk chooses resident at once; token by token below 3). The QwenModel must
  // outlive the CudaModel then.
  double host_cache_gb = -1;
  double host_cache_fraction = -1;
  // A memory plan's decision (runtime/memory_plan.h), taking precedence over
  // the sizes above when plan_vram_slots >= 0: routed experts per MoE layer
  // in VRAM (E: no tiers) and in pinned host memory (-1: all the others;
  // fewer than E - plan_vram_slots: the disk tier).
  int plan_vram_slots = -1, plan_host_slots = -1;
  // Decode-step and prefill settings (tests, benchmarks); the defaults are
  // the fastest paths.
  DecodeOptions decode;
  // The CUDA device the model goes to (multi_gpu.h puts one per rank).
  int device = 0;
};

// Counters of the tiered expert cache (all zero / disabled without one).
struct CudaTierStats {
  bool enabled = false;
  uint64_t vram_hits = 0, host_hits = 0, disk_hits = 0;  // routed-expert choices served from each tier
  uint64_t promotions = 0, promoted_bytes = 0;
  int layers = 0, experts_per_layer = 0, slots_per_layer = 0, host_slots_per_layer = 0;
  int64_t expert_bytes = 0;  // one expert: gate + up + down
  bool disk = false;            // host slots are a cache over the model's files (else: the experts outside VRAM)
  double host_pin_seconds = 0;  // time taken pinning the host slots at load
  uint64_t staged_layers = 0;   // prompt chunks' MoE layers whose host experts were staged in VRAM at once
  // Decode steps' host-tier experts copied ahead by the copy engine
  // (host_prefetch.cuh), the choices that read such a copy, and the chosen
  // host-tier experts copied after the router.
  uint64_t prefetched = 0, prefetch_used = 0;
  uint64_t copied_after = 0;
};

// A conversation's device state copied to host memory (the server's
// conversation snapshots): the KV rows in use, the conv and delta-rule
// states, in the order CudaModel::save_state writes them.
struct CudaStateImage {
  KvConfig kv;
  int64_t pos = 0;
  bool drafting = false;  // a drafting state's: also the MTP head's KV rows and hidden state
  std::vector<std::vector<uint8_t>> buffers;
  size_t bytes() const {
    size_t n = 0;
    for (const auto& b : buffers) n += b.size();
    return n;
  }
};

// A conversation's device state copied within device memory (the server's
// conversation snapshots while they fit the backend's VRAM budget): the
// buffers of a CudaStateImage back to back in one allocation, written by
// device-to-device copies queued on the model's stream, so that taking one
// waits for nothing (the next step on that stream, a restore and a
// download all come after the copies). Freeing it is a device call: under
// the same lock as the model's other calls.
struct CudaDeviceImage {
  CudaDeviceImage() = default;
  ~CudaDeviceImage();
  CudaDeviceImage(const CudaDeviceImage&) = delete;
  CudaDeviceImage& operator=(const CudaDeviceImage&) = delete;
  KvConfig kv;
  int64_t pos = 0;
  bool drafting = false;
  std::vector<size_t> sizes;  // each buffer's bytes, in CudaStateImage's order (snapkv's layout apart)
  std::vector<uint8_t> meta;  // snapkv: the cut layout (host memory; CudaStateImage's last buffer), else empty
  int dev = 0;
  void* data = nullptr;  // the buffers, each at a 256-byte aligned offset
  size_t bytes() const {
    size_t n = meta.size();
    for (size_t z : sizes) n += z;
    return n;
  }
};

// One sequence's part of CudaModel::forward_batch (runtime/backend.h's
// BatchItem): its state, the tokens it feeds, which logits go where, and
// where the argmax of its last logits goes (mode Last; logits may then be
// null: the batched step picks it on the device).
struct CudaBatchItem {
  CudaState* state = nullptr;
  const int32_t* ids = nullptr;
  int64_t n = 0;
  LogitsMode mode = LogitsMode::Last;
  float* logits = nullptr;
  int32_t* argmax = nullptr;
};

// Picks draft token `step` (0-based) from the MTP head's logits [vocab]
// (host memory); empty: the argmax, picked on the device.
using CudaDraftPicker = std::function<int32_t(const float* logits, int64_t step)>;

class CudaModel {
 public:
  // Whether a CUDA device can be used; `why` receives the reason if not, and
  // `too_old` whether that reason is a GPU older than the kernels (a GPU is
  // there, unlike a machine without one or a build without CUDA).
  static bool available(std::string* why = nullptr, bool* too_old = nullptr);
  // Free and total memory of the GPU models are uploaded to (cudaMemGetInfo);
  // false without a usable one.
  static bool memory_info(int64_t* free_bytes, int64_t* total_bytes);
  // Uploads the weights of a loaded model (bf16/f16/f32 kept as stored).
  static std::unique_ptr<CudaModel> upload(const QwenModel& m, const CudaOptions& o = {});
  ~CudaModel();

  const ModelConfig& config() const;
  std::string device_name() const;
  int64_t weight_bytes_total() const;      // bytes of weights in device memory
  int64_t weight_bytes_per_token() const;  // bytes of weights one decoded token reads

  // A state for this KV configuration (every dtype and retention policy).
  // drafting (--mtp): the state also keeps the MTP head's KV cache in step
  // with what it consumes; Error without a head, with h2o/tova retention or
  // with routed experts outside VRAM.
  std::unique_ptr<CudaState> new_state(const KvConfig& kv, bool drafting = false) const;
  // Where a state goes when its conversation ends: kept for the next
  // new_state of the same KV layout (full retention, its KV not grown past
  // its first capacity, no MTP head or restore point; at most kFreeStates),
  // else freed. A server's request then makes no ~45 cudaMallocs on its way
  // to its first token, nor cudaFrees (which wait for the device) after its
  // last. The kept ones hold their VRAM (a server's: no more states than
  // it had running at once).
  void release_state(std::unique_ptr<CudaState> st) const noexcept;
  static constexpr size_t kFreeStates = 32;
  size_t free_states() const;  // kept for reuse now (tests)
  // Whether the model came with an MTP head (uploaded with it).
  bool has_mtp() const;
  // A drafting state: n tokens the head proposes after `next` (chosen from
  // the state's last logits, not fed), each picked by `pick` from the
  // head's logits. The state is unchanged (as the CPU's cpu::mtp_draft).
  void draft(CudaState& st, int32_t next, int64_t n, const CudaDraftPicker& pick, int32_t* drafted) const;

  // The state copied to host memory, and a new state from such a copy
  // (taken from this model; an Error names a mismatch).
  CudaStateImage save_state(const CudaState& st) const;
  std::unique_ptr<CudaState> load_state(const CudaStateImage& img) const;
  // The same copy kept in device memory: the copies queued, nothing waited
  // for (a few microseconds of host time; the copy engine moves ~60 MB in
  // tens of microseconds). Null when the allocation fails (the caller then
  // takes save_state). state_image_bytes: what either copy holds, for a
  // budget decided before copying.
  std::unique_ptr<CudaDeviceImage> save_state_device(const CudaState& st) const;
  size_t state_image_bytes(const CudaState& st) const;
  // Free and total memory of this model's GPU now (cudaMemGetInfo alone).
  void vram(int64_t* free_bytes, int64_t* total_bytes) const;
  std::unique_ptr<CudaState> load_state(const CudaDeviceImage& img) const;
  // A device copy moved to host memory (waits for its copies and the download).
  CudaStateImage download(const CudaDeviceImage& img) const;

  // A restore point kept on the device (speculative decoding's roll-back):
  // copies, in the state's own spare buffers, of what feeding more tokens
  // overwrites (the conv and delta-rule states, windowed KV caches, the MTP
  // head's hidden state); a full cache's rows past the position are simply
  // overwritten later. rollback() returns the state to the last mark (one
  // mark per state; an Error without one). Not for h2o/tova caches (their
  // slots move): snapshots (save_state) serve those.
  void mark_rollback(CudaState& st) const;
  void rollback(CudaState& st) const;
  int64_t rollback_position(const CudaState& st) const;  // the mark's position, -1 without one
  // Takes back the tokens fed after `position` where the last forward()
  // was a verify pass (a drafting state fed 2..8 tokens over a full cache:
  // it keeps the recurrent states after each of its tokens) and `position`
  // is within it: true. Otherwise false, with nothing changed (roll back
  // to a mark and feed again).
  bool take_back(CudaState& st, int64_t position) const;
  // Whether feeding n tokens to st now is such a verify pass.
  bool keeps_rows(CudaState& st, int64_t n) const;

  // The positions the KV cache of full-attention layer `layer` (0-based
  // among those layers) holds, ascending, as KvCache::positions() (tests).
  std::vector<int64_t> kv_positions(const CudaState& st, int layer) const;
  // --kv-resident: the slots the last attention of layer `layer` read for
  // KV head kv_head, ascending, as KvCache::quest_selected() (tests).
  std::vector<int64_t> kv_selected(const CudaState& st, int layer, int kv_head) const;

  // Same contract as cpu::forward (backend/cpu/forward.h): ids checked against the vocabulary first.
  void forward(CudaState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits) const;
  // One step over several sequences (distinct states): each item's result
  // equals forward() on it alone. Items of several tokens (prompt chunks)
  // go through forward() first; then the single tokens of two or more
  // sequences take one batched decode step (Prefill::step_batch: each
  // weight read once for all of them), one alone the decode step. All ids
  // are checked against the vocabulary before any state is touched.
  void forward_batch(const CudaBatchItem* items, int64_t count) const;
  // Greedy decoding without host round trips: feeds `first`, then each
  // argmax in turn, n steps; out receives the n argmax ids.
  void decode_greedy(CudaState& st, int32_t first, int64_t n, int32_t* out) const;
  // forward() wanting each token's argmax only (best[n]; ties: the lower
  // id): on the device for a verify pass, else from the rows of logits.
  void forward_argmax_rows(CudaState& st, const int32_t* ids, int64_t n, int32_t* best) const;

  // Graph capture of the decode step (default on); off: plain launches.
  void set_use_graph(bool on);
  // Tiered expert cache counters (call with no step in flight), and reset.
  CudaTierStats tier_stats() const;
  void reset_tier_stats();

  struct Impl;

 private:
  friend struct CudaModelAccess;  // the backend's other units (cuda_bench.h's functions)
  CudaModel();
  std::unique_ptr<Impl> p_;
};

}  // namespace flashmoe
