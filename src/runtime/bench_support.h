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
// checkpoint); routed experts in bf16 or q8/q4 in groups of `group`.
std::unique_ptr<Backend> synthetic_backend(const ModelConfig& c, QuantKind experts, int group,
                                           const GpuOptions& o);

struct Bandwidth {
  double gbps = 0;   // bytes read + written per second / 1e9
  std::string what;  // how it was measured, for the report
};
// The copy bandwidth of the memory the backend's weights live in (a
// memcpy over the pool's threads; a device-to-device copy on a GPU).
Bandwidth weight_memory_bandwidth(const Backend& b, ThreadPool& pool);
// The host-to-device link from pinned memory, GB/s (0 where there is none).
double host_link_gbps(const Backend& b);

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
