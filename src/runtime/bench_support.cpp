#include "runtime/bench_support.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "backend/cuda/cuda_bench.h"
#include "runtime/cuda_backend_impl.h"

namespace flashmoe {

namespace {

const CudaBackend* as_cuda(const Backend& b) { return dynamic_cast<const CudaBackend*>(&b); }

// Plain memcpy bandwidth (bytes copied per second) over two buffers of
// `bytes` each.
double memcpy_gbps(ThreadPool& pool, size_t bytes) {
  using Clock = std::chrono::steady_clock;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  const int64_t mib = int64_t(bytes >> 20);
  auto copy = [&] {
    pool.parallel_for(mib, [&](int64_t b0, int64_t b1) {
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
  return double(mib << 20) / best / 1e9;  // each byte read once, written once
}

// The memory (not cache) bandwidth on `threads` threads: buffers of twice the
// last-level cache (at least 64 MiB, at most 1 GiB each; a server CPU's L3
// can hold 256 MiB), copied in a child process so that they never count in
// the bench's own resident set.
double memory_gbps(int threads) {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  const size_t bytes = std::clamp<size_t>(2 * size_t(std::max(0L, llc)), size_t(64) << 20, size_t(1) << 30);
  int fd[2];
  if (pipe(fd) != 0) fail(std::string("bench: cannot start the bandwidth probe: ") + std::strerror(errno));
  const pid_t pid = fork();
  if (pid < 0) fail(std::string("bench: cannot start the bandwidth probe: ") + std::strerror(errno));
  if (pid == 0) {
    close(fd[0]);
    double g = 0;
    try {
      ThreadPool pool(threads);
      g = memcpy_gbps(pool, bytes);
    } catch (...) {
      g = 0;  // reported by the parent
    }
    const ssize_t w = write(fd[1], &g, sizeof g);
    _exit(w == sizeof g ? 0 : 1);
  }
  close(fd[1]);
  double g = 0;
  const ssize_t got = read(fd[0], &g, sizeof g);
  close(fd[0]);
  waitpid(pid, nullptr, 0);
  if (got != sizeof g || !(g > 0))
    fail("bench: the bandwidth probe (a copy of 2 x " + std::to_string(bytes >> 20) + " MiB) failed");
  return g;
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
  return {memory_gbps(pool.size()), "memcpy on " + std::to_string(pool.size()) + " threads (buffers past the LLC)"};
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
