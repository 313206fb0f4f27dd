// Benchmark-only entry points of the CUDA backend (flashmoe bench, tests of
// published model sizes): kept out of CudaModel, whose API is what the
// runtime uses. Plain C++ header; without CUDA each one throws
// DeviceError(Unavailable) (cuda_bench_stub.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "core/matrix.h"
#include "format/config.h"

namespace flashmoe {

// One kernel class of the decode step, over the profiled steps.
struct CudaKernelTime {
  std::string name;
  double ms = 0;     // total over the profiled steps
  int launches = 0;  // kernel launches of this class over the profiled steps
};

// The routed experts of a synthetic model: bf16 (None), q8/q4 in groups
// of `group` columns (the layout flashmoe pack writes), or FP8 blocks
// (Fp8Block, 128 x 128). fp8_weights: the projections and the shared
// expert in FP8 blocks too (as an FP8 release stores them; the embedding,
// lm_head and router stay bf16); needs FP8 experts.
struct CudaSyntheticOptions {
  QuantKind experts = QuantKind::None;
  int group = 64;
  bool fp8_weights = false;
  bool mtp_head = false;  // also a random MTP head (bench --mtp), its experts in VRAM
};

// Random weights of the given dimensions, built on the device (no
// checkpoint): for benchmarks of published model sizes. The disk tier
// (host_cache_*) needs files and is refused.
std::unique_ptr<CudaModel> cuda_synthetic_model(const ModelConfig& c, uint64_t seed, const CudaOptions& o,
                                                const CudaSyntheticOptions& s);
// The batched decode step through CUDA graphs or plain launches
// (DecodeOptions::batch_graph), switched on a loaded model (bench: both
// measured on one model).
void cuda_set_batch_graph(CudaModel& m, bool on);
// The batched step's routed-expert product (DecodeOptions::batch_experts),
// switched on a loaded model (bench: both paths measured on one model).
void cuda_set_batch_experts(CudaModel& m, DecodeOptions::BatchExperts path);
// Device-to-device cudaMemcpy bandwidth, bytes read + written per second / 1e9.
double cuda_copy_bandwidth_gbps(const CudaModel& m);
// Host-to-device cudaMemcpy bandwidth from pinned memory, GB/s.
double cuda_host_link_gbps(const CudaModel& m);
// Tiered experts: the host link's rates for the bytes of one and of ten
// host-tier experts (layer 0's first host slots): cudaMemcpyAsync (the copy
// engine), a zero-copy read kernel, and both at once; then a host round
// trip's latency. Empty without a host tier.
std::string cuda_link_rates(const CudaModel& m);
// Host-tier experts by the copy engine (host_prefetch.cuh) switched on a
// loaded model, for side-by-side measurements and tests: on with n copies
// ahead per MoE layer (0-4; next: predicted at the previous MoE layer's
// router, else each from the layer's input), or off (the zero-copy expert
// kernels and the decode graph). Returns whether it is on (false where the
// model has no host tier of q4/q8 experts).
bool cuda_set_host_copies(CudaModel& m, bool on, int n = 1, bool next = true);
// Time per kernel class of `steps` decode steps (plain launches, events
// between kernels), feeding `first` then each argmax; advances `st` by
// `steps` tokens.
std::vector<CudaKernelTime> cuda_profile_decode(const CudaModel& m, CudaState& st, int32_t first, int steps);

}  // namespace flashmoe
