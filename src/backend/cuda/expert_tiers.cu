// The tiered expert cache: VRAM slots over pinned host memory (see the header).
#include "backend/cuda/expert_tiers.cuh"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>

#include "backend/cuda/cuda_check.cuh"
#include "core/error.h"

namespace flashmoe::cuda {

namespace {

// Points expert e of a layer at new storage (tiered expert cache).
__global__ void set_expert_kernel(const void** gu_tab, const void** down_tab, int* tier, int e, const void* gu,
                                  const void* down, int t) {
  gu_tab[e] = gu;
  down_tab[e] = down;
  tier[e] = t;
}

// Tables of a layer read through its staging buffer: an expert in host
// memory (tier 1) at host slot h is at stage + h * gu (gate/up) and
// stage_down + h * down; the others as the layer's tables say.
__global__ void staged_tables_kernel(const void* const* gu_tab, const void* const* down_tab, const int* tier, int E,
                                     const uint8_t* host_gu, const uint8_t* stage_gu, const uint8_t* stage_down,
                                     size_t gu, size_t down, const void** out_gu, const void** out_down) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  if (tier[e] == 1) {
    const size_t h = size_t(static_cast<const uint8_t*>(gu_tab[e]) - host_gu) / gu;
    out_gu[e] = stage_gu + h * gu;
    out_down[e] = stage_down + h * down;
  } else {
    out_gu[e] = gu_tab[e];
    out_down[e] = down_tab[e];
  }
}

constexpr int kSnapshotEvery = 8;     // tokens (decode steps) between count snapshots
constexpr int kPromotionsPerLayer = 2;  // per snapshot: bounds the link traffic spent on promotions
}  // namespace

ExpertTiers::ExpertTiers(int layers, int E, size_t gu_bytes, size_t down_bytes, int slots, int host_slots, bool disk)
    : layers_(layers),
      E_(E),
      slots_(slots),
      hslots_(disk ? std::clamp(host_slots, 1, E) : std::max(1, E - slots)),
      disk_(disk),
      vram_per_layer_(disk ? std::max(slots, 1) : slots + kSwapSpares),
      gu_(gu_bytes),
      down_(down_bytes) {
  const size_t per_layer = size_t(hslots_) * (gu_ + down_);
  const auto t0 = std::chrono::steady_clock::now();
  for (int l = 0; l < layers; ++l) {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, per_layer, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      char buf[200];
      std::snprintf(buf, sizeof buf, "%.1f GB", double(per_layer) * layers / 1e9);
      fail_device(DeviceFailure::OutOfMemory, std::string("--gpu-expert-cache: pinning ") + buf +
                                                  " of host memory for the experts outside VRAM failed (" +
                                                  cuda_msg(e) + ")");
    }
    host_.push_back(static_cast<uint8_t*>(p));
  }
  pin_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int l = 0; l < layers; ++l)
    vram_.push_back(static_cast<uint8_t*>(
        dev_alloc(size_t(vram_per_layer_) * (gu_ + down_), "GPU expert cache (layer " + std::to_string(l) + ")")));
  if (!disk && layers > 1) {
    stage_ = static_cast<uint8_t*>(dev_alloc(per_layer, "prompt staging of one layer's host experts"));
    d_stage_gu_tab_ = static_cast<const void**>(dev_alloc(size_t(E) * sizeof(void*), "expert tables"));
    d_stage_down_tab_ = static_cast<const void**>(dev_alloc(size_t(E) * sizeof(void*), "expert tables"));
  }
  const size_t n = size_t(layers) * E;
  d_gu_tab_ = static_cast<const void**>(dev_alloc(n * sizeof(void*), "expert tables"));
  d_down_tab_ = static_cast<const void**>(dev_alloc(n * sizeof(void*), "expert tables"));
  d_tier_ = static_cast<int*>(dev_alloc(n * sizeof(int), "expert tables"));
  d_counts_ = static_cast<unsigned*>(dev_alloc(n * sizeof(unsigned), "expert counters"));
  d_hits_ = static_cast<unsigned long long*>(dev_alloc(2 * sizeof(unsigned long long), "expert counters"));
  CK(cudaMemset(d_counts_, 0, n * sizeof(unsigned)));
  CK(cudaMemset(d_hits_, 0, 2 * sizeof(unsigned long long)));
  CK(cudaMallocHost(&h_counts_, n * sizeof(unsigned)));
  CK(cudaEventCreateWithFlags(&snap_, cudaEventDisableTiming));
  CK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  where_.assign(n, -1);
  owner_.assign(size_t(layers) * vram_per_layer_, -1);
  busy_.assign(n, 0);
  score_.assign(n, 0.0);
  last_.assign(n, 0);
  hwhere_.assign(n, -1);
  howner_.assign(size_t(layers) * hslots_, -1);
  hstamp_.assign(size_t(layers) * hslots_, 0);
  spare_.assign(size_t(layers), {});
  if (!disk)
    for (auto& v : spare_)
      for (int t = 0; t < kSwapSpares; ++t) v.push_back(slots + t);
  // Disk tier: expert e in host slot e; otherwise expert e >= slots in host slot e - slots.
  const int first = disk ? 0 : slots;
  for (int l = 0; l < layers; ++l)
    for (int e = first; e < std::min(E, first + hslots_); ++e) {
      hwhere_[size_t(l) * E_ + e] = e - first;
      howner_[size_t(l) * hslots_ + e - first] = e;
    }
}

void ExpertTiers::host_ptrs(int l, int e, const void** g, const void** d) const {
  const int h = hwhere_[size_t(l) * E_ + e];
  *g = *d = nullptr;
  if (h < 0) return;
  void *hg = nullptr, *hd = nullptr;
  CK(cudaHostGetDevicePointer(&hg, host_gu(l) + size_t(h) * gu_, 0));
  CK(cudaHostGetDevicePointer(&hd, host_down(l) + size_t(h) * down_, 0));
  *g = hg;
  *d = hd;
}

ExpertTiers::~ExpertTiers() {
  if (copy_) cudaStreamSynchronize(copy_);
  for (auto& p : pending_) cudaEventDestroy(p.done);
  for (auto* p : host_) cudaFreeHost(p);
  for (auto* p : vram_) cudaFree(p);
  for (void* p : {static_cast<void*>(d_gu_tab_), static_cast<void*>(d_down_tab_), static_cast<void*>(d_tier_),
                  static_cast<void*>(d_counts_), static_cast<void*>(d_hits_), static_cast<void*>(stage_),
                  static_cast<void*>(d_stage_gu_tab_), static_cast<void*>(d_stage_down_tab_)})
    cudaFree(p);
  if (h_counts_) cudaFreeHost(h_counts_);
  if (snap_) cudaEventDestroy(snap_);
  if (copy_) cudaStreamDestroy(copy_);
}

void ExpertTiers::start() {
  const size_t n = size_t(layers_) * E_;
  std::vector<const void*> gu(n), dn(n);
  std::vector<int> tier(n);
  std::vector<uint8_t> stage;  // disk tier: a VRAM expert without a host copy is read here first
  for (int l = 0; l < layers_; ++l)
    for (int e = 0; e < E_; ++e) {
      const size_t i = size_t(l) * E_ + e;
      if (e < slots_) {
        uint8_t* s = vram_gu(l, e);
        const int h = hwhere_[i];
        if (disk_ && h >= 0) {
          CK(cudaMemcpy(s, host_gu(l) + size_t(h) * gu_, gu_, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(s + gu_, host_down(l) + size_t(h) * down_, down_, cudaMemcpyHostToDevice));
        } else if (disk_) {
          stage.resize(gu_ + down_);
          loader_(l, e, stage.data(), stage.data() + gu_);
          CK(cudaMemcpy(s, stage.data(), gu_ + down_, cudaMemcpyHostToDevice));
        }  // else the caller wrote it there
        gu[i] = s;
        dn[i] = s + gu_;
        tier[i] = 0;
        where_[i] = e;
        owner_[size_t(l) * vram_per_layer_ + e] = e;
      } else {
        host_ptrs(l, e, &gu[i], &dn[i]);
        tier[i] = gu[i] ? 1 : 2;
      }
    }
  CK(cudaMemcpy(d_gu_tab_, gu.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_down_tab_, dn.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_tier_, tier.data(), n * sizeof(int), cudaMemcpyHostToDevice));
}

void ExpertTiers::set(cudaStream_t s, int l, int e, int slot) {
  const void *g, *d;
  if (slot >= 0) {
    uint8_t* p = vram_gu(l, slot);
    g = p;
    d = p + gu_;
  } else {
    host_ptrs(l, e, &g, &d);
  }
  const size_t base = size_t(l) * E_;
  set_expert_kernel<<<1, 1, 0, s>>>(d_gu_tab_ + base, d_down_tab_ + base, d_tier_ + base, e, g, d,
                                    slot >= 0 ? 0 : g ? 1 : 2);
  check(cudaGetLastError(), "set_expert_kernel");
}

void ExpertTiers::ensure(cudaStream_t s, int l, const int* ids, int k) {
  const size_t base = size_t(l) * E_, hbase = size_t(l) * hslots_;
  ++clock_;
  for (int j = 0; j < k; ++j) {
    const int e = ids[j];
    if (e < 0 || e >= E_) fail("expert id " + std::to_string(e) + " out of range in the tiered cache");
    const int h = hwhere_[base + e];
    if (h >= 0) hstamp_[hbase + h] = clock_;
    if (where_[base + e] >= 0 || h >= 0) continue;
    // Disk: the least recently used host slot whose expert this step does
    // not use and no promotion is copying (if promotions hold all the
    // others, they are waited for).
    auto pick = [&] {
      int v = -1;
      for (int t = 0; t < hslots_; ++t) {
        const int o = howner_[hbase + t];
        if (o >= 0 && (busy_[base + o] || std::find(ids, ids + k, o) != ids + k)) continue;
        if (v < 0 || hstamp_[hbase + t] < hstamp_[hbase + v]) v = t;
      }
      return v;
    };
    int victim = pick();
    if (victim < 0 && !pending_.empty()) {
      CK(cudaStreamSynchronize(copy_));
      land(s);
      victim = pick();
    }
    if (victim < 0) fail("the GPU host expert cache has fewer slots per layer than the experts one step uses");
    const int old = howner_[hbase + victim];
    if (old >= 0) {
      hwhere_[base + old] = -1;
      if (where_[base + old] < 0) set(s, l, old, -1);  // now on disk only
    }
    loader_(l, e, host_gu(l) + size_t(victim) * gu_, host_down(l) + size_t(victim) * down_);
    howner_[hbase + victim] = e;
    hwhere_[base + e] = victim;
    hstamp_[hbase + victim] = clock_;
    set(s, l, e, -1);
    ++disk_reads_;
  }
}

void ExpertTiers::land(cudaStream_t main) {
  // Promotions whose copy has landed: point the table at the slot. Steps
  // enqueued from here on read the expert from VRAM.
  for (size_t i = 0; i < pending_.size();) {
    const cudaError_t q = cudaEventQuery(pending_[i].done);
    if (q == cudaErrorNotReady) {
      ++i;
      continue;
    }
    check(q, "expert promotion copy");
    if (pending_[i].phase > 0) {
      if (land_swap(main, pending_[i])) pending_.erase(pending_.begin() + long(i));
      else ++i;
      continue;
    }
    const Pending p = pending_[i];
    set(main, p.layer, p.expert, p.slot);
    where_[size_t(p.layer) * E_ + p.expert] = p.slot;
    busy_[size_t(p.layer) * E_ + p.expert] = 0;
    cudaEventDestroy(p.done);
    pending_.erase(pending_.begin() + long(i));
  }
}

// After a copy on the copy stream: makes it wait for everything enqueued on
// the step stream so far (the steps that may still read its destination).
static void after_main(cudaStream_t main, cudaStream_t copy) {
  cudaEvent_t e;
  CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaEventRecord(e, main));
  CK(cudaStreamWaitEvent(copy, e, 0));
  cudaEventDestroy(e);  // destruction is deferred until the event completes
}

bool ExpertTiers::land_swap(cudaStream_t main, Pending& p) {
  const int l = p.layer;
  const size_t base = size_t(l) * E_;
  cudaEventDestroy(p.done);
  p.done = nullptr;
  if (p.phase == 1) {
    // The hot expert is in the spare slot: read from there from now on; its
    // host slot takes the evicted expert once the steps before this point
    // (which may read the hot one there) have run.
    set(main, l, p.expert, p.slot);
    where_[base + p.expert] = p.slot;
    owner_[size_t(l) * vram_per_layer_ + p.slot] = p.expert;
    hwhere_[base + p.expert] = -1;
    after_main(main, copy_);
    const int from = where_[base + p.evicted];
    CK(cudaMemcpyAsync(host_gu(l) + size_t(p.host) * gu_, vram_gu(l, from), gu_, cudaMemcpyDeviceToHost, copy_));
    CK(cudaMemcpyAsync(host_down(l) + size_t(p.host) * down_, vram_down(l, from), down_, cudaMemcpyDeviceToHost,
                       copy_));
    CK(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
    CK(cudaEventRecord(p.done, copy_));
    p.phase = 2;
    return false;
  }
  // The evicted expert is in host memory: read from there; its VRAM slot is
  // the layer's spare (the next copy into it waits for the steps before this).
  const int from = where_[base + p.evicted];
  hwhere_[base + p.evicted] = p.host;
  howner_[size_t(l) * hslots_ + p.host] = p.evicted;
  set(main, l, p.evicted, -1);
  where_[base + p.evicted] = -1;
  owner_[size_t(l) * vram_per_layer_ + from] = -1;
  spare_[size_t(l)].push_back(from);
  busy_[base + p.expert] = 0;
  busy_[base + p.evicted] = 0;
  return true;
}

void ExpertTiers::maintain(cudaStream_t main, int tokens) {
  land(main);
  if (snap_pending_) {
    const cudaError_t q = cudaEventQuery(snap_);
    if (q == cudaErrorNotReady) return;
    check(q, "expert count snapshot");
    snap_pending_ = false;
    plan(main);
  }
  steps_ += tokens;
  if (steps_ >= kSnapshotEvery) {
    steps_ = 0;
    CK(cudaMemcpyAsync(h_counts_, d_counts_, size_t(layers_) * E_ * sizeof(unsigned), cudaMemcpyDeviceToHost, main));
    CK(cudaEventRecord(snap_, main));
    snap_pending_ = true;
  }
}

// Scores are decayed choice counts. An expert outside VRAM replaces the
// coldest resident one only when clearly hotter (2x + 1): with near-uniform
// routing nothing churns, with skewed routing the hot set moves in.
void ExpertTiers::plan(cudaStream_t main) {
  if (slots_ == 0) return;
  if (!disk_) {
    plan_swaps(main);
    return;
  }
  for (int l = 0; l < layers_; ++l) {
    const size_t base = size_t(l) * E_;
    for (int e = 0; e < E_; ++e) {
      const unsigned c = h_counts_[base + e];
      score_[base + e] = score_[base + e] * 0.5 + double(c - last_[base + e]);
      last_[base + e] = c;
    }
    std::vector<int> cand, vict;
    for (int e = 0; e < E_; ++e)
      if (!busy_[base + e] && (where_[base + e] >= 0 || hwhere_[base + e] >= 0))  // disk tier: promote from host
        (where_[base + e] < 0 ? cand : vict).push_back(e);
    auto hotter = [&](int a, int b) { return score_[base + a] > score_[base + b] || (score_[base + a] == score_[base + b] && a < b); };
    std::sort(cand.begin(), cand.end(), hotter);
    std::sort(vict.begin(), vict.end(), [&](int a, int b) { return hotter(b, a); });
    for (int i = 0; i < kPromotionsPerLayer && i < int(cand.size()) && i < int(vict.size()); ++i) {
      const int in = cand[size_t(i)], out = vict[size_t(i)];
      if (!(score_[base + in] > 2.0 * score_[base + out] + 1.0)) break;
      const int slot = where_[base + out];
      // Evict first (on the step stream: steps already enqueued may still read
      // the slot), then copy into it on the copy stream once that has run.
      set(main, l, out, -1);
      where_[base + out] = -1;
      owner_[size_t(l) * vram_per_layer_ + slot] = in;
      busy_[base + in] = 1;
      cudaEvent_t evicted, done;
      CK(cudaEventCreateWithFlags(&evicted, cudaEventDisableTiming));
      CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      CK(cudaEventRecord(evicted, main));
      CK(cudaStreamWaitEvent(copy_, evicted, 0));
      uint8_t* s = vram_[size_t(l)] + size_t(slot) * (gu_ + down_);
      const int h = hwhere_[base + in];  // busy_ keeps it there until the copy is done
      CK(cudaMemcpyAsync(s, host_gu(l) + size_t(h) * gu_, gu_, cudaMemcpyHostToDevice, copy_));
      CK(cudaMemcpyAsync(s + gu_, host_down(l) + size_t(h) * down_, down_, cudaMemcpyHostToDevice, copy_));
      CK(cudaEventRecord(done, copy_));
      cudaEventDestroy(evicted);  // destruction is deferred until the event completes
      pending_.push_back({l, in, slot, done});
      ++promotions_;
      promoted_bytes_ += gu_ + down_;
    }
  }
}

// Without the disk tier: a swap per spare VRAM slot at most, the hottest
// host experts against the coldest resident ones, on the same 2x + 1 rule
// as plan().
void ExpertTiers::plan_swaps(cudaStream_t main) {
  for (int l = 0; l < layers_; ++l) {
    const size_t base = size_t(l) * E_;
    for (int e = 0; e < E_; ++e) {
      const unsigned c = h_counts_[base + e];
      score_[base + e] = score_[base + e] * 0.5 + double(c - last_[base + e]);
      last_[base + e] = c;
    }
    std::vector<int>& spare = spare_[size_t(l)];
    if (spare.empty()) continue;
    std::vector<int> cand, vict;
    for (int e = 0; e < E_; ++e)
      if (!busy_[base + e]) (where_[base + e] < 0 ? cand : vict).push_back(e);
    auto hotter = [&](int a, int b) { return score_[base + a] > score_[base + b] || (score_[base + a] == score_[base + b] && a < b); };
    std::sort(cand.begin(), cand.end(), hotter);
    std::sort(vict.begin(), vict.end(), [&](int a, int b) { return hotter(b, a); });
    for (size_t i = 0; !spare.empty() && i < cand.size() && i < vict.size(); ++i) {
      const int in = cand[i], out = vict[i];
      if (!(score_[base + in] > 2.0 * score_[base + out] + 1.0)) break;
      const int h = hwhere_[base + in], slot = spare.back();
      spare.pop_back();
      busy_[base + in] = busy_[base + out] = 1;
      after_main(main, copy_);  // steps that read the spare slot's last expert
      CK(cudaMemcpyAsync(vram_gu(l, slot), host_gu(l) + size_t(h) * gu_, gu_, cudaMemcpyHostToDevice, copy_));
      CK(cudaMemcpyAsync(vram_down(l, slot), host_down(l) + size_t(h) * down_, down_, cudaMemcpyHostToDevice, copy_));
      cudaEvent_t done;
      CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      CK(cudaEventRecord(done, copy_));
      Pending p{l, in, slot, done};
      p.phase = 1;
      p.evicted = out;
      p.host = h;
      pending_.push_back(p);
      ++promotions_;
      promoted_bytes_ += 2 * (gu_ + down_);  // a swap crosses the link both ways
    }
  }
}

ExpertTiers::Tables ExpertTiers::stage(cudaStream_t s, int l, int T, int k) {
  if (!stage_ || int64_t(T) * k < E_) return {};
  // Host slots of a swap in flight may be rewritten meanwhile: no table
  // entry points at such a slot (the swap moved them to VRAM first), so the
  // staged copy of it is never read.
  CK(cudaMemcpyAsync(stage_, host_gu(l), size_t(hslots_) * (gu_ + down_), cudaMemcpyHostToDevice, s));
  void* host_dev = nullptr;
  CK(cudaHostGetDevicePointer(&host_dev, host_gu(l), 0));
  staged_tables_kernel<<<(E_ + 127) / 128, 128, 0, s>>>(gu_tab(l), down_tab(l), d_tier_ + size_t(l) * E_, E_,
                                                        static_cast<const uint8_t*>(host_dev), stage_,
                                                        stage_ + size_t(hslots_) * gu_, gu_, down_, d_stage_gu_tab_,
                                                        d_stage_down_tab_);
  check(cudaGetLastError(), "staged_tables_kernel");
  ++staged_;
  return {d_stage_gu_tab_, d_stage_down_tab_};
}

void ExpertTiers::drain(cudaStream_t main) {
  // A swap's second copy is issued when its first lands: repeat until none is left.
  while (!pending_.empty()) {
    CK(cudaStreamSynchronize(copy_));
    land(main);
  }
}

CudaTierStats ExpertTiers::stats() const {
  CudaTierStats s;
  unsigned long long h[2] = {0, 0};
  CK(cudaMemcpy(h, d_hits_, sizeof h, cudaMemcpyDeviceToHost));
  s.enabled = true;
  s.vram_hits = h[0];
  s.disk_hits = std::min<uint64_t>(h[1], disk_reads_);  // the top-k counted them as outside VRAM
  s.host_hits = h[1] - s.disk_hits;
  s.host_slots_per_layer = hslots_;
  s.disk = disk_;
  s.host_pin_seconds = pin_seconds_;
  s.staged_layers = staged_;
  s.promotions = promotions_;
  s.promoted_bytes = promoted_bytes_;
  s.layers = layers_;
  s.experts_per_layer = E_;
  s.slots_per_layer = slots_;
  s.expert_bytes = int64_t(gu_ + down_);
  return s;
}

void ExpertTiers::reset_stats() {
  CK(cudaMemset(d_hits_, 0, 2 * sizeof(unsigned long long)));
  disk_reads_ = 0;
  staged_ = 0;
  promotions_ = 0;
  promoted_bytes_ = 0;
}

}  // namespace flashmoe::cuda
