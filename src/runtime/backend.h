// The runtime interface: what the engine, the server and the command line
// see of a compute backend. A Backend runs the forward pass of one loaded
// model on one device; a State is one conversation's position in it (KV
// caches, GatedDeltaNet and conv states) wherever that device keeps it.
// Nothing above this header knows which device it is: the CPU and CUDA
// implementations live in runtime/cpu_backend.* and runtime/cuda_backend.*,
// and runtime/device.h picks one.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "format/config.h"
#include "kv/kv_config.h"
#include "model/qwen_model.h"

namespace flashmoe {

// Memory a state holds, in bytes: the KV caches and the fixed-size
// recurrent (GatedDeltaNet + conv) states.
struct StateBytes {
  int64_t kv = 0, recurrent = 0;
};

// A conversation's state copied out of its backend (to host memory, or kept
// in the device's own memory where a backend can: CUDA under a VRAM budget),
// to be restored later into a state of the same backend, model and KV
// config. Like a State, it must not outlive its backend.
class StateSnapshot {
 public:
  virtual ~StateSnapshot() = default;
  virtual int64_t position() const = 0;
  virtual size_t bytes() const = 0;  // memory the copy holds, host or device
};

class State {
 public:
  virtual ~State() = default;
  virtual int64_t position() const = 0;  // tokens consumed
  virtual StateBytes bytes() const = 0;
  virtual std::unique_ptr<StateSnapshot> snapshot() const = 0;
  // Replaces this state with a copy of `snap`; throws Error when it was taken
  // from another backend or with another KV configuration.
  virtual void restore(const StateSnapshot& snap) = 0;
  // A restore point for taking back tokens fed after it (speculative
  // decoding's verify pass), given to restore() of this same state; valid
  // until its next rollback_point(). The default is a snapshot(); a backend
  // may keep it on its device and copy only what later tokens overwrite.
  virtual std::unique_ptr<StateSnapshot> rollback_point() { return snapshot(); }
  // Takes back the tokens fed after `position` when the last forward pass
  // kept what that needs (a GPU's verify pass keeps the recurrent states
  // after each of its tokens) and `position` lies within that pass: true.
  // Otherwise false and nothing changes (restore a rollback_point() and
  // feed again). The default keeps nothing.
  virtual bool take_back(int64_t /*position*/) { return false; }
  // Whether feeding n tokens now keeps what take_back needs to return to
  // any of them (then no rollback_point() is needed before).
  virtual bool keeps_rows(int64_t /*n*/) { return false; }
  // The positions the KV cache of attention layer `layer` (0-based among the
  // attention layers) holds, ascending (tests of the retention policies).
  virtual std::vector<int64_t> kv_positions(int layer) const = 0;
  // --kv-resident: the slots the last attention of layer `layer` read for
  // KV head kv_head, ascending (tests of the Quest store).
  virtual std::vector<int64_t> kv_selected(int layer, int kv_head) const {
    (void)layer, (void)kv_head;
    fail("kv_selected: not available on this backend");
  }
};

// Counters of where routed experts came from (--stats): the expert store on
// the CPU, the VRAM / host / disk tiers on a GPU.
struct ExpertTierStats {
  bool enabled = false;
  uint64_t vram_hits = 0, host_hits = 0, disk_hits = 0;
  uint64_t promotions = 0, promoted_bytes = 0;
  int layers = 0, experts_per_layer = 0, slots_per_layer = 0, host_slots_per_layer = 0;
  int64_t expert_bytes = 0;  // one expert: gate + up + down
  bool disk = false;            // host slots cache experts read from the model's files
  double host_pin_seconds = 0;  // time pinning the host slots took at load
  uint64_t prefetched = 0, prefetch_used = 0;  // host-tier experts copied ahead by decode steps; choices reading a copy
  uint64_t copied_after = 0;  // chosen host-tier experts copied to VRAM after the router by decode steps
};

// One sequence's part of a batched step: its state, the tokens it feeds this
// step (one for a decoding sequence, a chunk of its prompt for one being
// admitted), which logits it wants and where they go (as forward()).
// argmax (mode Last only): receives the id of the largest of the last
// token's logits (ties: the lower id, as core/argmax.h); `logits` may then
// be null, and a backend that keeps the logits on a device picks the id
// there and copies only it back (a greedy sequence needs nothing else).
struct BatchItem {
  State* state = nullptr;
  const int32_t* ids = nullptr;
  int64_t n = 0;
  LogitsMode mode = LogitsMode::Last;
  float* logits = nullptr;
  int32_t* argmax = nullptr;
};

// For backends that produce logits on the host: the items with an argmax
// and no logits buffer get a row of `scratch` ([count][vocab] as needed);
// finish() then writes every item's argmax from its logits.
class BatchArgmax {
 public:
  // Checks each item's argmax request (Error: argmax without mode Last).
  BatchArgmax(const BatchItem* items, int64_t count, int64_t vocab);
  const BatchItem* items() const { return items_.data(); }
  void finish() const;

 private:
  std::vector<BatchItem> items_;
  std::vector<float> scratch_;
  int64_t vocab_;
};

// Picks draft token `step` (0-based) from the MTP head's logits [vocab]; an
// empty one (Backend::draft) picks the argmax (ties: the lower id), on a
// GPU on the device (greedy drafting: no logits copied to the host).
using DraftPicker = std::function<int32_t(const float* logits, int64_t step)>;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* kind() const = 0;           // "cpu" or "cuda"
  virtual std::string device_name() const = 0;    // e.g. "cpu" or "NVIDIA H200"
  // "cpu", or the kind with the device's name: "cuda (NVIDIA H200)".
  std::string label() const {
    const std::string k = kind(), n = device_name();
    return n == k ? k : k + " (" + n + ")";
  }
  virtual const ModelConfig& config() const = 0;
  // The host model: config, weights (views of the files), expert store.
  virtual const QwenModel& model() const = 0;
  // False for a model built on the device (`--synthetic` on a GPU): it has
  // no host weights and no expert store, and model() fails.
  virtual bool has_host_model() const { return true; }

  // A state for this KV configuration (every dtype and retention policy).
  virtual std::unique_ptr<State> new_state(const KvConfig& kv) const = 0;

  // Feeds n tokens to `st`. LogitsMode::All: logits receives [n, vocab];
  // Last: [vocab] for the last token; None: nothing. Ids outside the
  // vocabulary are an Error before the state is touched. `pool`: the host
  // threads the call may use. Safe to call from several threads on
  // different states (a backend that runs one call at a time serialises
  // them itself, in arrival order).
  virtual void forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                       ThreadPool& pool) const = 0;
  // One step over several independent sequences (continuous batching):
  // each item's result equals forward() on it alone; a backend that can
  // share weight reads across the batch overrides this. Items must name
  // distinct states. The default runs the items one after another.
  virtual void forward_batch(const BatchItem* items, int64_t count, ThreadPool& pool) const;
  // forward() that also returns the residual stream after each layer
  // ([L+1][n*H]): `flashmoe logits --hidden`, a debugging aid only the CPU
  // backend implements (the others throw Error).
  virtual void forward_capturing(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                                 ThreadPool& pool, std::vector<std::vector<float>>* hidden) const;
  // Greedy decoding: feeds `first`, then each argmax in turn, n steps; out
  // receives the n argmax ids (on a GPU without a host round trip per token).
  virtual void greedy(State& st, int32_t first, int64_t n, int32_t* out, ThreadPool& pool) const = 0;
  // forward() of n tokens wanting only the argmax of each token's logits
  // (best[n]; ties: the lower id): a greedy verify pass, which a GPU answers
  // with n ids instead of n rows of logits. The default takes the rows.
  virtual void forward_argmax_rows(State& st, const int32_t* ids, int64_t n, int32_t* best, ThreadPool& pool) const;

  // Self-speculative decoding with the model's multi-token-prediction head
  // (engine/speculative.h). A drafting state is a state (forward, snapshot,
  // restore as any other) that also keeps the head's KV cache in step with
  // what it consumed; Error when the model has no MTP head or the backend
  // cannot draft (the defaults: only the CPU implements them so far).
  virtual std::unique_ptr<State> new_drafting_state(const KvConfig& kv) const;
  // Drafts n tokens after `next` (chosen from st's last logits, not yet
  // fed): the head runs n times, each on its previous output and token, and
  // `pick` chooses each token from the head's logits. st is unchanged.
  virtual void draft(State& st, int32_t next, int64_t n, const DraftPicker& pick, int32_t* drafted,
                     ThreadPool& pool) const;

  // Bytes of weights the backend holds, and that one decoded token reads.
  virtual int64_t weight_bytes_total() const = 0;
  virtual int64_t weight_bytes_per_token() const = 0;

  // --stats: one line (or a few) on where the routed experts came from since
  // the last reset; `tokens` > 0 adds per-token figures.
  virtual std::string expert_stats(int64_t tokens = 0) const = 0;
  virtual ExpertTierStats tier_stats() const { return {}; }
  virtual void reset_expert_stats() const = 0;
};

}  // namespace flashmoe
