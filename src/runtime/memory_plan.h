// Where a model's routed experts live on one GPU, decided before anything
// is allocated: from the free VRAM (cudaMemGetInfo), the host memory the
// process may still take (/proc/meminfo's MemAvailable, capped by a cgroup
// limit) and the model's sizes. The experts take what VRAM is left beside
// everything else (less a margin, 2 spare slots per layer for promotions and
// a buffer for one layer's host experts, which prompts copy in at once); the
// rest go to pinned host memory up to
// a bound (less a margin); beyond that a real model reads them from its
// files (the disk tier) and a synthetic one cannot run: one Error naming the
// numbers and the option to change, never an out-of-memory kill.
//
// Pure arithmetic over the sizes given (the probes are separate), so the
// tests feed made-up machines.
#pragma once
#include <cstdint>
#include <string>

#include "format/config.h"
#include "runtime/device.h"

namespace flashmoe {

// What the machine offers.
struct MachineMemory {
  int64_t vram_free = 0, vram_total = 0;
  int64_t host_available = 0;  // what this process may still take
  std::string host_source;     // how host_available was found, for the printout
};

// What the model needs.
struct ModelFootprint {
  std::string name;          // for messages
  int64_t device_fixed = 0;  // VRAM for everything but the routed experts
  int64_t expert_bytes = 0;  // one routed expert (gate + up + down) in its device format
  int moe_layers = 0, experts = 0, top_k = 0;
  bool has_files = false;  // experts beyond the host tier can be read from the model's files
  int swap_spares = 0;     // VRAM slots per layer the tiers keep free for promotions (kTierSwapSpares)
  // What to change when it cannot fit at all (synthetic: "--layers"), after the tier options.
  std::string smaller_model_hint;
};

// The margins the plan keeps free: VRAM for the CUDA context's own
// allocations, allocation rounding and what the estimate of device_fixed
// misses; host memory for the process itself and the rest of the machine.
int64_t vram_margin(const MachineMemory& m);  // 4 GiB
int64_t host_margin(const MachineMemory& m);  // 8 GiB or 10% of host_available, whichever is larger

struct MemoryPlan {
  bool tiered = false;  // false: every expert in VRAM
  bool disk = false;    // the host slots cache experts read from the model's files
  int vram_slots = 0;   // experts per MoE layer in VRAM (experts when not tiered)
  int host_slots = 0;   // experts per MoE layer in pinned host memory
  int moe_layers = 0, experts = 0, swap_spares = 0;
  int64_t expert_bytes = 0, device_fixed = 0;
  int64_t staging_bytes = 0;  // VRAM for one layer's host experts, copied in at once for prompts
  int64_t vram_free = 0, vram_margin = 0, host_available = 0, host_margin = 0;
  std::string host_source;
  int64_t vram_expert_bytes() const { return int64_t(vram_slots) * moe_layers * expert_bytes; }
  int64_t host_expert_bytes() const { return int64_t(host_slots) * moe_layers * expert_bytes; }
  // Experts held in neither VRAM nor host memory (read from the files when chosen).
  int64_t disk_expert_bytes() const {
    return disk ? int64_t(experts - vram_slots - host_slots) * moe_layers * expert_bytes : 0;
  }
  // Several lines: VRAM / host / disk, bytes and expert counts, the margins.
  std::string describe() const;
};

// The plan for `o`'s request: --gpu-expert-cache GB|N% (VRAM for experts as
// given), auto (as many as fit), or nothing (every expert in VRAM when they
// fit, else auto); --gpu-host-cache GB|N% bounds the host tier (else: host
// memory less its margin). Throws Error when it cannot fit.
MemoryPlan plan_memory(const MachineMemory& m, const ModelFootprint& f, const GpuOptions& o);

// MemAvailable from /proc/meminfo, capped by the cgroup v2 limit
// (/sys/fs/cgroup/memory.max minus memory.current) when one is set.
void probe_host_memory(MachineMemory* m);

// VRAM the CUDA backend takes for a model besides its routed experts: the
// other weights (`weight_bytes` per value: 2 for bf16, 4 where the upload
// keeps f32), the folded routers, the decode step's and the batched
// prefill's buffers (2048-token chunks), one conversation's KV cache and
// recurrent state for `context` tokens (f32 KV), and, with `staging`, a
// synthetic model's one-layer staging of its experts.
int64_t device_fixed_bytes(const ModelConfig& c, int weight_bytes, int64_t expert_bytes, int64_t context,
                           bool staging);

// One routed expert's bytes on the device: q8/q4 (`bits`) in groups of
// `group` columns in the layout of make_qexpert (backend/cuda/device_model.cuh:
// data, bf16 scales and biases, each part 16-byte aligned); bits 0: float
// weights of `float_bytes` each.
int64_t device_expert_bytes(int bits, int group, int64_t H, int64_t I, int float_bytes = 2);

// The footprint of a synthetic model (bench --synthetic: bf16 weights,
// experts as `bits`/`group` say) and of a loaded one, for the memory plan.
ModelFootprint synthetic_footprint(const ModelConfig& c, int bits, int group, int64_t context);
ModelFootprint model_footprint(const QwenModel& m, int64_t context);

}  // namespace flashmoe
