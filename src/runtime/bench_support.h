// What `flashmoe bench` needs beyond the runtime interface, kept out of the
// backends' production classes: models built on the device from random
// weights of a published size, the bandwidth a memory-bound decode can
// approach, and a per-kernel time breakdown of the decode step.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/matrix.h"
#include "runtime/backend.h"
#include "runtime/device.h"

namespace flashmoe {

// A model of config `c` with random weights built on the GPU (no
// checkpoint); routed experts in bf16, q8/q4 in groups of `group`, or FP8
// blocks (Fp8Block: 128 x 128). fp8_weights: every linear weight an FP8
// release converts (projections, shared experts, experts) in FP8 blocks,
// the embedding, lm_head and router in bf16 (experts must then be Fp8Block).
// mtp_head: also a random MTP head (bench --mtp).
std::unique_ptr<Backend> synthetic_backend(const ModelConfig& c, QuantKind experts, int group,
                                           const GpuOptions& o, bool fp8_weights = false, bool mtp_head = false);

// The same model built in host memory for the CPU backend, its weights
// filled by `pool`'s threads.
std::unique_ptr<Backend> synthetic_cpu_backend(const ModelConfig& c, QuantKind experts, int group, ThreadPool& pool,
                                               bool fp8_weights = false, bool mtp_head = false);

struct Bandwidth {
  double gbps = 0;   // bytes read + written per second / 1e9
  std::string what;  // how it was measured, for the report
};
// The bandwidth of the memory the backend's weights are read from: on a GPU
// a device-to-device copy; on the CPU the DRAM read probe below when the
// weights are more than twice the last-level cache, else a 32 MiB memcpy
// (a cache figure, as a model that small is read from the cache).
Bandwidth weight_memory_bandwidth(const Backend& b, ThreadPool& pool);
// The size of this CPU's last-level cache in bytes (sysfs; 0 where unknown).
int64_t last_level_cache_bytes();
// The host's DRAM read bandwidth: a read-only streaming sum over `bytes`
// (several times the last-level cache, so no pass is served from cache),
// split over the pool's threads; best of `passes` timed passes.
Bandwidth dram_read_bandwidth(ThreadPool& pool, int64_t bytes, int passes = 5);
// The host-to-device link from pinned memory, GB/s (0 where there is none).
double host_link_gbps(const Backend& b);

// Tiered experts on a GPU: the host link's rates, copy engine against a
// zero-copy read kernel, and a host round trip (cuda_link_rates); empty
// elsewhere.
std::string host_link_rates(const Backend& b);
// The GPU's host-tier experts by the copy engine (on: n copies ahead per
// MoE layer, next: predicted at the previous MoE layer's router) or by the
// zero-copy expert kernels (off); false where the backend has no host tier
// of q4/q8 experts.
bool set_host_copies(const Backend& b, bool on, int n, bool next);

// Free and total GPU memory (cudaMemGetInfo); false without a usable GPU.
bool gpu_memory_info(int64_t* free_bytes, int64_t* total_bytes);

// Whether the decode step has a CUDA-graph form, and turning it on or off
// (a no-op where there is none).
bool has_decode_graph(const Backend& b);
void set_decode_graph(const Backend& b, bool on);

struct KernelTime {
  std::string name;
  double ms = 0;     // total over the profiled steps
  int launches = 0;  // launches over the profiled steps
};
// Per-kernel-class time of `steps` decode steps, advancing `st`; empty on
// a backend without kernels to time (the CPU).
std::vector<KernelTime> profile_decode(const Backend& b, State& st, int32_t first, int steps);

}  // namespace flashmoe
