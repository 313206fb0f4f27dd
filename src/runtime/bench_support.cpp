#include "runtime/bench_support.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/error.h"
#include "backend/cuda/cuda_bench.h"
#include "runtime/cuda_backend_impl.h"

namespace flashmoe {

namespace {

const CudaBackend* as_cuda(const Backend& b) { return dynamic_cast<const CudaBackend*>(&b); }

// Plain memcpy bandwidth over buffers far larger than the caches.
double memcpy_gbps(ThreadPool& pool) {
  using Clock = std::chrono::steady_clock;
  // 2 x 32 MiB: far larger than any cache, small next to a model (2 x 256 MiB
  // made the probe, not the model, the peak RSS of a bench run).
  const size_t bytes = size_t(32) << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  auto copy = [&] {
    pool.parallel_for(int64_t(bytes >> 20), [&](int64_t b0, int64_t b1) {
      std::memcpy(b.data() + (b0 << 20), a.data() + (b0 << 20), size_t(b1 - b0) << 20);
    });
  };
  copy();
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    auto t = Clock::now();
    copy();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t).count());
  }
  return double(bytes) / best / 1e9;  // bytes copied per second (each read once, written once)
}

}  // namespace

std::unique_ptr<Backend> synthetic_backend(const ModelConfig& c, QuantKind experts, int group,
                                           const GpuOptions& o) {
  const CudaOptions co = cuda_options(o);
  CudaSyntheticOptions so;
  so.experts = experts;
  so.group = group;
  return std::make_unique<CudaBackend>(nullptr, cuda_synthetic_model(c, 1234, co, so));
}

Bandwidth weight_memory_bandwidth(const Backend& b, ThreadPool& pool) {
  if (const CudaBackend* c = as_cuda(b))
    return {cuda_copy_bandwidth_gbps(c->device_for_bench()), "device copy (cudaMemcpy D2D, read+written)"};
  return {memcpy_gbps(pool), "memcpy on " + std::to_string(pool.size()) + " threads"};
}

double host_link_gbps(const Backend& b) {
  const CudaBackend* c = as_cuda(b);
  return c ? cuda_host_link_gbps(c->device_for_bench()) : 0.0;
}

bool has_decode_graph(const Backend& b) { return as_cuda(b) != nullptr; }

void set_decode_graph(const Backend& b, bool on) {
  if (const CudaBackend* c = as_cuda(b)) c->device_for_bench().set_use_graph(on);
}

std::vector<KernelTime> profile_decode(const Backend& b, State& st, int32_t first, int steps) {
  std::vector<KernelTime> out;
  const CudaBackend* c = as_cuda(b);
  if (!c) return out;
  for (const CudaKernelTime& k : cuda_profile_decode(c->device_for_bench(), CudaBackend::device_state_for_bench(st), first, steps))
    out.push_back({k.name, k.ms, k.launches});
  return out;
}

}  // namespace flashmoe
