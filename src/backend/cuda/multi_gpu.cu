// Expert parallelism over several GPUs of one host (multi_gpu.h): the rank
// models, their expert tables masked to the experts each owns, the
// all-reduce after each MoE layer, and the calls run on one thread per rank.
#include "backend/cuda/multi_gpu.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "backend/cuda/rank_threads.h"
#include "core/error.h"
#include "experts/expert_partition.h"
#include "model/plan.h"

#ifdef FLASHMOE_HAVE_NCCL
#include <nccl.h>
#endif

namespace flashmoe {

#ifdef FLASHMOE_HAVE_NCCL

namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  std::string msg = std::string("NCCL ") + what + ": " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) msg += std::string(" (") + last + ")";
  fail_device(DeviceFailure::Runtime, msg);
}

// The rank's contribution to the sum, on ranks > 0: what the expert
// kernels added to the residual (x after them minus x before).
__global__ void residual_delta_kernel(const float* x, float* kept, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) kept[i] = x[i] - kept[i];
}

}  // namespace

struct ExpertParallel {
  int rank = 0, ranks = 1;
  ncclComm_t comm = nullptr;
  float* kept = nullptr;  // [H]: ranks > 0: the residual before the experts, then their sum
  float* kept_rows = nullptr;  // [chunk x H]: the same for the batched prefill's rows
};

// Rank 0 adds its experts (and the shared expert) to the residual in x as
// one GPU does; the other ranks' experts add to their copy of it, and their
// contribution is that copy's change. So one rank alone reduces to exactly
// the single-GPU step (an in-place all-reduce over one rank leaves x as is).
void CudaModel::Impl::ep_before_ffn() {
  if (ep->rank == 0) return;
  CK(cudaMemcpyAsync(ep->kept, x, size_t(c.hidden_size) * 4, cudaMemcpyDeviceToDevice, stream));
  pdl_next = false;
}

void CudaModel::Impl::ep_after_ffn() {
  const int H = int(c.hidden_size);
  const float* send = x;
  if (ep->rank > 0) {
    residual_delta_kernel<<<(H + 255) / 256, 256, 0, stream>>>(x, ep->kept, H);
    check(cudaGetLastError(), "residual_delta_kernel");
    send = ep->kept;
  }
  nccl_check(ncclAllReduce(send, x, size_t(H), ncclFloat, ncclSum, ep->comm, stream), "all-reduce of the experts");
  // After a real all-reduce (an NCCL kernel) the next kernel waits for it
  // whole. Over one rank NCCL enqueues nothing for an in-place all-reduce
  // (ncclLaunchOneRank), so the next kernel keeps its PDL overlap with the
  // expert kernels: without it --gpus 1 decoded 6.8% slower (394 vs 423
  // tokens/s on the 35B, bench/NOTES-cuda.md).
  if (ep->ranks > 1) pdl_next = false;
}

// The batched prefill's T rows (at most a chunk), as above.
void CudaModel::Impl::ep_before_rows(float* rows, int T) {
  if (ep->rank == 0) return;
  CK(cudaMemcpyAsync(ep->kept_rows, rows, size_t(T) * size_t(c.hidden_size) * 4, cudaMemcpyDeviceToDevice, stream));
}

void CudaModel::Impl::ep_after_rows(float* rows, int T) {
  const int n = T * int(c.hidden_size);
  const float* send = rows;
  if (ep->rank > 0) {
    residual_delta_kernel<<<std::min((n + 255) / 256, 4096), 256, 0, stream>>>(rows, ep->kept_rows, n);
    check(cudaGetLastError(), "residual_delta_kernel");
    send = ep->kept_rows;
  }
  nccl_check(ncclAllReduce(send, rows, size_t(n), ncclFloat, ncclSum, ep->comm, stream),
             "all-reduce of the experts (prefill)");
}

#else

void CudaModel::Impl::ep_before_ffn() {}
void CudaModel::Impl::ep_after_ffn() {}
void CudaModel::Impl::ep_before_rows(float*, int) {}
void CudaModel::Impl::ep_after_rows(float*, int) {}

#endif

struct CudaMultiModel::Impl {
  std::vector<std::unique_ptr<CudaModel>> models;
  std::vector<std::vector<int>> owner;  // per MoE layer
#ifdef FLASHMOE_HAVE_NCCL
  std::vector<ncclComm_t> comms;
  std::vector<ExpertParallel> eps;
#endif
  ~Impl() {
    models.clear();  // their streams drained before the communicators go
#ifdef FLASHMOE_HAVE_NCCL
    for (ncclComm_t c : comms)
      if (c) ncclCommDestroy(c);
#endif
  }

  template <class F>
  void each_rank(F f) const {
    run_on_ranks(int(models.size()), f);
  }
};

bool CudaMultiModel::built_with_nccl() {
#ifdef FLASHMOE_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

std::string CudaMultiModel::nccl_version() {
#ifdef FLASHMOE_HAVE_NCCL
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (version unknown)";
  // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch from 2.9 on.
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
#else
  return "this build has no NCCL (configure found no nccl.h / libnccl; set NCCL_ROOT)";
#endif
}

int CudaMultiModel::device_count() {
  if (!CudaModel::available()) return 0;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

CudaMultiModel::CudaMultiModel() : p_(new Impl) {}
CudaMultiModel::~CudaMultiModel() = default;

namespace {

#ifdef FLASHMOE_HAVE_NCCL
// Rank r's model made an expert-parallel rank: the tables of its MoE layers
// send experts it does not own to one all-zero expert (gate, up and down
// all zero: its output is exactly 0 whatever the format, and its reads stay
// in L2), and ranks > 0 drop the shared expert (rank 0 adds it).
void make_rank(CudaModel& model, int rank, int ranks, const std::vector<std::vector<int>>& owner, ncclComm_t comm,
               ExpertParallel& ep) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  CK(cudaSetDevice(m.dev));
  if (m.tiers)
    fail("--gpus: the routed experts must all be in VRAM on every GPU (a tiered expert cache is not supported "
         "with several GPUs yet)");
  const int E = int(m.c.num_experts);
  // Expert strides from the contiguous tables (expert e at base + e * stride).
  struct Tab {
    DLayer* d;
    const std::vector<int>* own;
    std::vector<const void*> gu, dn;
  };
  std::vector<Tab> tabs;
  size_t zero_bytes = 0;
  for (const LayerPlan& l : m.plan.layers) {
    if (l.ffn != FfnKind::RoutedMoE) continue;
    DLayer& d = m.L[size_t(l.index)];
    const std::vector<int>& own = owner.at(size_t(l.moe_slot));
    if (rank > 0) d.has_shared = false;
    if (std::all_of(own.begin(), own.end(), [&](int o) { return o == rank; })) continue;
    Tab t{&d, &own, std::vector<const void*>(size_t(E)), std::vector<const void*>(size_t(E))};
    CK(cudaMemcpy(t.gu.data(), d.gu_tab, size_t(E) * sizeof(void*), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(t.dn.data(), d.down_tab, size_t(E) * sizeof(void*), cudaMemcpyDeviceToHost));
    if (E >= 2) {
      zero_bytes = std::max(zero_bytes, size_t(static_cast<const uint8_t*>(t.gu[1]) - static_cast<const uint8_t*>(t.gu[0])));
      zero_bytes = std::max(zero_bytes, size_t(static_cast<const uint8_t*>(t.dn[1]) - static_cast<const uint8_t*>(t.dn[0])));
    }
    tabs.push_back(std::move(t));
  }
  if (!tabs.empty()) {
    void* zero = m.alloc(zero_bytes, "the zero expert (experts other GPUs own)");
    CK(cudaMemset(zero, 0, zero_bytes));
    for (Tab& t : tabs) {
      for (int e = 0; e < E; ++e)
        if ((*t.own)[size_t(e)] != rank) t.gu[size_t(e)] = t.dn[size_t(e)] = zero;
      CK(cudaMemcpy(const_cast<const void**>(t.d->gu_tab), t.gu.data(), size_t(E) * sizeof(void*),
                    cudaMemcpyHostToDevice));
      CK(cudaMemcpy(const_cast<const void**>(t.d->down_tab), t.dn.data(), size_t(E) * sizeof(void*),
                    cudaMemcpyHostToDevice));
    }
  }
  ep.rank = rank;
  ep.ranks = ranks;
  ep.comm = comm;
  ep.kept = m.alloc_f(size_t(m.c.hidden_size), "expert-parallel residual");
  ep.kept_rows = m.alloc_f(size_t(m.chunk) * size_t(m.c.hidden_size), "expert-parallel residual rows");
  m.ep = &ep;
  CK(cudaDeviceSynchronize());
}
#endif

void check_devices(const std::vector<int>& devices) {
  if (!CudaMultiModel::built_with_nccl())
    fail_device(DeviceFailure::Unavailable, "--gpus: " + CudaMultiModel::nccl_version());
  if (devices.empty()) fail("--gpus: no GPU given");
  const int n = CudaMultiModel::device_count();
  if (n == 0) fail_device(DeviceFailure::Unavailable, "--gpus: no usable CUDA device");
  for (int d : devices)
    if (d < 0 || d >= n)
      fail("--gpus: GPU " + std::to_string(d) + " does not exist (" + std::to_string(n) + " visible: 0.." +
           std::to_string(n - 1) + ")");
}

#ifdef FLASHMOE_HAVE_NCCL
// The owner table: given per MoE layer, or even.
std::vector<std::vector<int>> owners(const ModelConfig& c, int moe_layers, int ranks,
                                     const std::vector<std::vector<int>>& given) {
  if (given.empty()) return std::vector<std::vector<int>>(size_t(moe_layers), partition_experts_evenly(c.num_experts, ranks));
  if (int(given.size()) != moe_layers)
    fail("--gpus: an expert partition of " + std::to_string(given.size()) + " layers for " +
         std::to_string(moe_layers) + " MoE layers");
  for (const auto& o : given) {
    if (int64_t(o.size()) != c.num_experts) fail("--gpus: an expert partition row of the wrong length");
    for (int r : o)
      if (r < 0 || r >= ranks) fail("--gpus: an expert owned by rank " + std::to_string(r) + " of " + std::to_string(ranks));
  }
  return given;
}
#endif

template <class Make>
std::unique_ptr<CudaMultiModel> build(CudaMultiModel::Impl& p, std::unique_ptr<CudaMultiModel> mm,
                                      const std::vector<int>& devices, const std::vector<std::vector<int>>& given,
                                      Make make) {
  check_devices(devices);
#ifdef FLASHMOE_HAVE_NCCL
  const int n = int(devices.size());
  // The lent multi-GPU machines require NVLink multicast off; a user's own
  // setting wins.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  for (int r = 0; r < n; ++r) p.models.push_back(make(devices[size_t(r)]));
  const ModelPlan& plan = CudaModelAccess::impl(*p.models[0]).plan;
  p.owner = owners(p.models[0]->config(), int(plan.moe_layers), n, given);
  p.comms.assign(size_t(n), nullptr);
  nccl_check(ncclCommInitAll(p.comms.data(), n, devices.data()), "communicators (ncclCommInitAll)");
  p.eps.resize(size_t(n));
  for (int r = 0; r < n; ++r) make_rank(*p.models[size_t(r)], r, n, p.owner, p.comms[size_t(r)], p.eps[size_t(r)]);
  // One all-reduce of each size the steps use, outside any graph capture:
  // NCCL connects a communicator's peers at its first collectives. One
  // thread drives every rank here, hence the group.
  for (bool rows : {false, true}) {
    nccl_check(ncclGroupStart(), "group start");
    for (int r = 0; r < n; ++r) {
      CudaModel::Impl& m = CudaModelAccess::impl(*p.models[size_t(r)]);
      CK(cudaSetDevice(m.dev));
      float* buf = rows ? p.eps[size_t(r)].kept_rows : p.eps[size_t(r)].kept;
      const size_t count = size_t(m.c.hidden_size) * (rows ? size_t(m.chunk) : 1);
      nccl_check(ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, p.comms[size_t(r)], m.stream), "first all-reduce");
    }
    nccl_check(ncclGroupEnd(), "group end");
  }
  for (int r = 0; r < n; ++r) {
    CudaModel::Impl& m = CudaModelAccess::impl(*p.models[size_t(r)]);
    CK(cudaSetDevice(m.dev));
    CK(cudaStreamSynchronize(m.stream));
  }
#else
  (void)p, (void)given, (void)make;
#endif
  return mm;
}

}  // namespace

std::unique_ptr<CudaMultiModel> CudaMultiModel::upload(const QwenModel& m, const CudaOptions& o,
                                                       const std::vector<int>& devices,
                                                       const std::vector<std::vector<int>>& owner) {
  std::unique_ptr<CudaMultiModel> mm(new CudaMultiModel);
  Impl& p = *mm->p_;
  return build(p, std::move(mm), devices, owner, [&](int dev) {
    CudaOptions r = o;
    r.device = dev;
    return CudaModel::upload(m, r);
  });
}

std::unique_ptr<CudaMultiModel> CudaMultiModel::synthetic(const ModelConfig& c, uint64_t seed, const CudaOptions& o,
                                                          const CudaSyntheticOptions& s,
                                                          const std::vector<int>& devices) {
  std::unique_ptr<CudaMultiModel> mm(new CudaMultiModel);
  Impl& p = *mm->p_;
  return build(p, std::move(mm), devices, {}, [&](int dev) {
    CudaOptions r = o;
    r.device = dev;
    return cuda_synthetic_model(c, seed, r, s);
  });
}

int CudaMultiModel::ranks() const { return int(p_->models.size()); }
const ModelConfig& CudaMultiModel::config() const { return p_->models.at(0)->config(); }
std::string CudaMultiModel::device_name() const {
  return std::to_string(ranks()) + " x " + p_->models.at(0)->device_name();
}
int64_t CudaMultiModel::weight_bytes_total() const {
  int64_t s = 0;
  for (const auto& m : p_->models) s += m->weight_bytes_total();
  return s;
}
int64_t CudaMultiModel::weight_bytes_per_token() const { return p_->models.at(0)->weight_bytes_per_token(); }
const CudaModel& CudaMultiModel::rank_model(int r) const { return *p_->models.at(size_t(r)); }
const std::vector<int>& CudaMultiModel::owner(int mi) const { return p_->owner.at(size_t(mi)); }

std::unique_ptr<CudaMultiState> CudaMultiModel::new_state(const KvConfig& kv) const {
  auto st = std::make_unique<CudaMultiState>();
  for (const auto& m : p_->models) st->ranks.push_back(m->new_state(kv));
  return st;
}

CudaStateImage CudaMultiModel::save_state(const CudaMultiState& st) const {
  return p_->models.at(0)->save_state(*st.ranks.at(0));
}

std::unique_ptr<CudaMultiState> CudaMultiModel::load_state(const CudaStateImage& img) const {
  auto st = std::make_unique<CudaMultiState>();
  for (const auto& m : p_->models) st->ranks.push_back(m->load_state(img));
  return st;
}

std::vector<int64_t> CudaMultiModel::kv_positions(const CudaMultiState& st, int layer) const {
  return p_->models.at(0)->kv_positions(*st.ranks.at(0), layer);
}

void CudaMultiModel::forward(CudaMultiState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits) const {
  check_token_ids(config(), ids, n);  // before any rank starts: no rank left waiting in a collective
  p_->each_rank([&](int r) {
    // Only rank 0's logits are read; the others skip the lm_head.
    p_->models[size_t(r)]->forward(*st.ranks[size_t(r)], ids, n, r == 0 ? mode : LogitsMode::None,
                                   r == 0 ? logits : nullptr);
  });
}

void CudaMultiModel::decode_greedy(CudaMultiState& st, int32_t first, int64_t n, int32_t* out) const {
  check_token_ids(config(), &first, 1);
  const int R = ranks();
  std::vector<int32_t> other(static_cast<size_t>(R > 1 ? R - 1 : 0) * static_cast<size_t>(n > 0 ? n : 0));
  int32_t* rest = other.data();
  p_->each_rank([&](int r) {
    int32_t* o = r == 0 ? out : rest + static_cast<size_t>(r - 1) * static_cast<size_t>(n);
    p_->models[static_cast<size_t>(r)]->decode_greedy(*st.ranks[static_cast<size_t>(r)], first, n, o);
  });
  for (int r = 1; r < R; ++r)
    if (!std::equal(out, out + n, rest + static_cast<size_t>(r - 1) * static_cast<size_t>(n)))
      fail_device(DeviceFailure::Runtime, "multi-GPU decode: rank " + std::to_string(r) +
                                              " picked other tokens than rank 0 (the ranks' states diverged)");
}

void CudaMultiModel::set_use_graph(bool on) {
  for (auto& m : p_->models) m->set_use_graph(on);
}

}  // namespace flashmoe
