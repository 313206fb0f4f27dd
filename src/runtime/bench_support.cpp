#include "runtime/bench_support.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "core/error.h"
#include "backend/cuda/cuda_bench.h"
#include "backend/cuda/cuda_model.h"
#include "model/synthetic_model.h"
#include "runtime/cpu_backend.h"
#include "runtime/cuda_backend_impl.h"
#include "runtime/memory_plan.h"
#include "runtime/multi_gpu_backend.h"

namespace flashmoe {

namespace {

const CudaBackend* as_cuda(const Backend& b) { return dynamic_cast<const CudaBackend*>(&b); }
const MultiGpuBackend* as_multi(const Backend& b) { return dynamic_cast<const MultiGpuBackend*>(&b); }

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

// Sum of the 64-bit words of [p, p + n), n a multiple of 4: four
// independent accumulators so the loads, not one add chain, bound the loop.
uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i < n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

// "260M", "2048K" or "512" (sysfs cache size) in bytes.
int64_t parse_cache_size(const std::string& s) {
  if (s.empty()) return 0;
  int64_t v = 0;
  try {
    v = std::stoll(s);
  } catch (...) {
    return 0;
  }
  const char unit = s.find_first_of("KMG") == std::string::npos ? ' ' : s[s.find_first_of("KMG")];
  return unit == 'K' ? v << 10 : unit == 'M' ? v << 20 : unit == 'G' ? v << 30 : v;
}

}  // namespace

int64_t last_level_cache_bytes() {
  int64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream type(dir + "type"), size(dir + "size");
    if (!type || !size) continue;
    std::string t, s;
    type >> t;
    size >> s;
    if (t != "Instruction") best = std::max(best, parse_cache_size(s));
  }
  return best;
}

Bandwidth dram_read_bandwidth(ThreadPool& pool, int64_t bytes, int passes) {
  using Clock = std::chrono::steady_clock;
  const int64_t chunk_words = int64_t(1) << 17;  // 1 MiB per work item
  const int64_t chunks = std::max<int64_t>(1, bytes / (chunk_words * 8));
  std::vector<uint64_t> buf(size_t(chunks * chunk_words));
  // Each thread touches the pages it will read (first touch places them on its node).
  pool.parallel_for(chunks, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t i = 0; i < chunk_words; ++i) buf[size_t(c * chunk_words + i)] = uint64_t(c * chunk_words + i);
  });
  std::vector<uint64_t> sums(static_cast<size_t>(chunks));
  auto pass = [&] {
    pool.parallel_for(chunks, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) sums[size_t(c)] = sum_words(buf.data() + c * chunk_words, size_t(chunk_words));
    });
  };
  pass();  // warm: page tables, the threads
  double best = 1e30;
  for (int r = 0; r < passes; ++r) {
    auto t = Clock::now();
    pass();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t).count());
  }
  // The sums are checked so the reads cannot be optimised away: word k holds k.
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  const uint64_t n = uint64_t(chunks * chunk_words);
  if (total != n * (n - 1) / 2) throw Error("bench: the bandwidth probe's sum is wrong (memory error?)");
  const double mib = double(buf.size() * 8) / double(1 << 20);
  return {double(buf.size() * 8) / best / 1e9,
          "DRAM read (streaming sum over " + std::to_string(int64_t(mib)) + " MiB on " + std::to_string(pool.size()) +
              " threads, read only)"};
}

std::unique_ptr<Backend> synthetic_backend(const ModelConfig& c, QuantKind experts, int group,
                                           const GpuOptions& o, bool fp8_weights, bool mtp_head) {
  const ModelFootprint f = synthetic_footprint(c, quant_bits(experts), group, o.plan_context);
  const CudaOptions co = cuda_options(o, &f);
  CudaSyntheticOptions so;
  so.experts = experts;
  so.group = group;
  so.fp8_weights = fp8_weights;
  so.mtp_head = mtp_head;
  if (!o.devices.empty()) {  // --gpus: the same weights on every GPU, experts split
    check_gpu_list(o);
    return std::make_unique<MultiGpuBackend>(nullptr, CudaMultiModel::synthetic(c, 1234, cuda_options(o), so, o.devices));
  }
  return std::make_unique<CudaBackend>(nullptr, cuda_synthetic_model(c, 1234, co, so));
}

std::unique_ptr<Backend> synthetic_cpu_backend(const ModelConfig& c, QuantKind experts, int group, ThreadPool& pool,
                                               bool fp8_weights, bool mtp_head) {
  return std::make_unique<CpuBackend>(
      std::shared_ptr<const QwenModel>(synthetic_cpu_model(c, experts, group, 1234, pool, fp8_weights, mtp_head)));
}

Bandwidth weight_memory_bandwidth(const Backend& b, ThreadPool& pool) {
  if (const CudaBackend* c = as_cuda(b))
    return {cuda_copy_bandwidth_gbps(c->device_for_bench()), "device copy (cudaMemcpy D2D, read+written)"};
  if (const MultiGpuBackend* m = as_multi(b)) {
    // The aggregate of the GPUs: rank 0's copy rate times their number.
    const int n = m->device().ranks();
    return {n * cuda_copy_bandwidth_gbps(m->device().rank_model(0)),
            "device copy (cudaMemcpy D2D, read+written) on GPU 0 x " + std::to_string(n) + " GPUs"};
  }
  const int64_t llc = last_level_cache_bytes();
  // A model that fits the cache is read from it, and a copy of 2 x 32 MiB
  // keeps the bench's RSS the model's; a model far larger than the cache is
  // read from DRAM, and the read probe over 4 x the cache is smaller than it.
  if (llc > 0 && b.weight_bytes_total() > 2 * llc) return dram_read_bandwidth(pool, 4 * llc);
  std::string where = llc > 0 && llc >= (int64_t(64) << 20)
                          ? " (within the " + std::to_string(llc >> 20) +
                                " MiB last-level cache: a cache figure; `flashmoe bench --bandwidth` measures DRAM)"
                          : "";
  return {memcpy_gbps(pool), "memcpy of 32 MiB on " + std::to_string(pool.size()) + " threads, read+written" + where};
}

double host_link_gbps(const Backend& b) {
  const CudaBackend* c = as_cuda(b);
  return c ? cuda_host_link_gbps(c->device_for_bench()) : 0.0;
}

std::string host_link_rates(const Backend& b) {
  const CudaBackend* c = as_cuda(b);
  return c ? cuda_link_rates(c->device_for_bench()) : std::string();
}

bool set_host_copies(const Backend& b, bool on, int n, bool next) {
  const CudaBackend* c = as_cuda(b);
  if (!c || !c->tier_stats().enabled) return false;
  return cuda_set_host_copies(c->device_for_bench(), on, n, next) == on;
}

bool gpu_memory_info(int64_t* free_bytes, int64_t* total_bytes) {
  return CudaModel::memory_info(free_bytes, total_bytes);
}

bool has_decode_graph(const Backend& b) { return as_cuda(b) != nullptr || as_multi(b) != nullptr; }

void set_decode_graph(const Backend& b, bool on) {
  if (const CudaBackend* c = as_cuda(b)) {
    c->device_for_bench().set_use_graph(on);
    cuda_set_batch_graph(c->device_for_bench(), on);  // --batch's steps too
  }
  if (const MultiGpuBackend* m = as_multi(b)) m->device_for_bench().set_use_graph(on);
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
