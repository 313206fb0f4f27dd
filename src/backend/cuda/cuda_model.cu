// The CUDA backend: weight upload, per-session device state, the decode step
// (one token through every layer, routing on the device) and its CUDA graph;
// prompts of several tokens are handed to the batched prefill (prefill.cu).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "backend/cpu/matmul_quant.h"
#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/delta_cluster.cuh"
#include "backend/cuda/device_model.cuh"
#include "backend/cuda/down_early.cuh"
#include "backend/cuda/expert_tiers.cuh"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/prefill.cuh"
#include "backend/cuda/quant_experts.cuh"
#include "core/dtype.h"
#include "core/error.h"
#include "model/plan.h"

namespace flashmoe {

using namespace flashmoe::cuda;

namespace {

constexpr int kRing = 8192;  // token-id ring on the device (prompt chunks, generated ids)
// Resident blocks per SM the row kernels' grids are sized for: 4 leaves room
// for the next kernel's blocks to become resident early under PDL; 8 was
// slower, 2-3 ran short of loads in flight (v6 in bench/NOTES-cuda.md).
constexpr int kBlocksPerSm = 4;

enum KernelClass { K_EMBED, K_PROJ, K_CONV, K_DELTA, K_ATTN, K_OUT, K_ROUTER, K_EXPERTS, K_LMHEAD, K_ARGMAX, K_N };
const char* kClassNames[K_N] = {"embed",      "in-proj (norm fused)", "conv1d",  "delta-rule", "attention",
                                "out-proj",   "router+topk",          "experts", "lm_head",    "argmax"};

}  // namespace

// ---------------------------------------------------------------- state

struct CudaState::Impl {
  int dev = 0;
  KvConfig kv;
  int64_t pos = 0;
  int cap = 0, window = 0, sinks = 0, kvt = KV_F32, ns = 0;
  bool h2o = false;  // heavy-hitter retention: cap slots, KvLayer acc / kpos
  size_t el = 4;
  int nkv = 0, hd = 0, nh = 0;
  std::vector<KvLayer> kvl;
  std::vector<float*> conv, ssm;
  float* scores = nullptr;
  int *d_pos = nullptr, *d_base = nullptr, *d_ids = nullptr, *d_out = nullptr, *d_step = nullptr;
  cudaGraphExec_t graphs[3] = {nullptr, nullptr, nullptr};

  void drop_graphs() {
    for (auto& g : graphs)
      if (g) {
        cudaGraphExecDestroy(g);
        g = nullptr;
      }
  }
  ~Impl() {
    cudaSetDevice(dev);
    drop_graphs();
    for (auto& l : kvl)
      for (void* p : {l.k, l.v, static_cast<void*>(l.ks), static_cast<void*>(l.vs), static_cast<void*>(l.acc),
                      static_cast<void*>(l.kpos)})
        cudaFree(p);
    for (float* p : conv) cudaFree(p);
    for (float* p : ssm) cudaFree(p);
    for (void* p : {static_cast<void*>(scores), static_cast<void*>(d_pos), static_cast<void*>(d_base),
                    static_cast<void*>(d_ids), static_cast<void*>(d_out), static_cast<void*>(d_step)})
      cudaFree(p);
  }
};

CudaState::~CudaState() = default;
int64_t CudaState::position() const { return p_->pos; }

// ---------------------------------------------------------------- model

struct CudaModel::Impl {
  ModelConfig c;
  int dev = 0;
  cudaDeviceProp prop{};
  std::vector<void*> allocs;
  DMat embed, lm_head;
  float* final_norm = nullptr;
  std::vector<DLayer> L;
  ModelPlan plan;  // the layers in order (make_plan), walked by the decode step and the prefill
  float* inv_freq = nullptr;  // plan.rope_inv_freq on the device
  float* ones = nullptr;
  float *x = nullptr, *proj = nullptr, *convout = nullptr, *lin_o = nullptr, *q = nullptr, *attn_o = nullptr,
        *rlogits = nullptr, *ew = nullptr, *hb = nullptr, *logits = nullptr;
  int* eids = nullptr;
  int maxI = 0;
  cudaStream_t stream = nullptr;
  bool use_graph = true;
  int chunk = 2048;  // prompt tokens per batched-prefill chunk (DecodeOptions::prefill_chunk, clamped)
  std::unique_ptr<Prefill> prefill;
  bool prefill_tried = false;
  unsigned* presel_done = nullptr;
  float* presel_w = nullptr;
  float* cat = nullptr;  // [H + O]: the layer's input residual (copied by the in-proj), then o (lin_o / attn_o)
  const void** sel = nullptr;  // [2k] expert row pointers chosen by the top-k
  CudaOptions opts;
  std::unique_ptr<ExpertTiers> tiers;
  int64_t bytes_total = 0, bytes_per_token = 0;
  float* pinned_logits = nullptr;
  int* pinned_ids = nullptr;
  int* pinned_eids = nullptr;  // disk tier: the chosen experts of a layer
  // profiling: an event after each launch, with its kernel class
  bool profiling = false;
  std::vector<cudaEvent_t> events;
  std::vector<int> event_class;

  ~Impl() {
    cudaSetDevice(dev);
    if (stream) cudaStreamSynchronize(stream);
    prefill.reset();
    tiers.reset();
    for (void* p : allocs) cudaFree(p);
    for (auto e : events) cudaEventDestroy(e);
    if (pinned_logits) cudaFreeHost(pinned_logits);
    if (pinned_ids) cudaFreeHost(pinned_ids);
    if (pinned_eids) cudaFreeHost(pinned_eids);
    if (stream) cudaStreamDestroy(stream);
  }

  void* alloc(size_t bytes, const std::string& what) {
    void* p = dev_alloc(bytes, what);
    allocs.push_back(p);
    return p;
  }
  float* alloc_f(size_t n, const std::string& what) { return static_cast<float*>(alloc(n * 4, what)); }
  float* upload_vec(const std::vector<float>& v, const std::string& what) {
    float* p = alloc_f(v.size(), what);
    CK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return p;
  }

  // Rows of several host matrices (same cols) written one after the other
  // into dst (host memory) in storage type dt; returns the bytes written.
  static size_t write_rows_host(const std::vector<Matrix>& parts, int dt, uint8_t* dst) {
    size_t off = 0;
    std::vector<float> row;
    for (const Matrix& p : parts) {
      const size_t n = size_t(p.rows) * p.cols, out_bytes = n * dt_size(dt);
      if (p.quantized()) {  // dequantised as the CPU does, then stored as dt
        row.resize(size_t(p.cols));
        for (int64_t r = 0; r < p.rows; ++r) {
          cpu::quant_dequant_row(p, r, row.data());
          const size_t o = size_t(r) * p.cols;
          for (int64_t i = 0; i < p.cols; ++i) {
            if (dt == DT_F32) reinterpret_cast<float*>(dst + off)[o + i] = row[size_t(i)];
            else if (dt == DT_F16) reinterpret_cast<uint16_t*>(dst + off)[o + i] = f32_to_f16(row[size_t(i)]);
            else reinterpret_cast<uint16_t*>(dst + off)[o + i] = f32_to_bf16(row[size_t(i)]);
          }
        }
      } else if (dt_of(p.dtype) == dt) {
        std::memcpy(dst + off, p.data, out_bytes);
      } else {
        for (size_t i = 0; i < n; ++i) {  // widen (or narrow, when forced)
          float f;
          switch (p.dtype) {
            case DType::F32: f = static_cast<const float*>(p.data)[i]; break;
            case DType::F16: f = f16_to_f32(static_cast<const uint16_t*>(p.data)[i]); break;
            default: f = bf16_to_f32(static_cast<const uint16_t*>(p.data)[i]); break;
          }
          if (dt == DT_F32) reinterpret_cast<float*>(dst + off)[i] = f;
          else if (dt == DT_F16) reinterpret_cast<uint16_t*>(dst + off)[i] = f32_to_f16(f);
          else reinterpret_cast<uint16_t*>(dst + off)[i] = f32_to_bf16(f);
        }
      }
      off += out_bytes;
    }
    return off;
  }

  // Rows of several host matrices (same cols) stacked into one device matrix,
  // in the common storage type (f32 when they differ or when forced).
  DMat upload_rows(const std::vector<Matrix>& parts, const std::string& what, int force_dt = -1) {
    DMat m;
    m.cols = int(parts.at(0).cols);
    int dt = force_dt >= 0 ? force_dt : storage_dt(parts[0]);
    int64_t rows = 0;
    for (const Matrix& p : parts) {
      if (p.cols != m.cols) fail("CUDA backend: " + what + ": parts differ in columns");
      if (force_dt < 0 && storage_dt(p) != dt) dt = DT_F32;
      rows += p.rows;
    }
    m.dt = dt;
    m.rows = int(rows);
    if ((size_t(m.cols) * dt_size(dt)) % 16 != 0)
      fail_device(DeviceFailure::Unsupported, "CUDA backend: " + what + " has " + std::to_string(m.cols) +
                                                  " columns; rows must be a multiple of 16 bytes");
    m.p = alloc(m.bytes(), what);
    uint8_t* dst = static_cast<uint8_t*>(m.p);
    std::vector<uint8_t> buf;
    for (const Matrix& p : parts) {  // one part at a time: bounded host memory
      buf.resize(size_t(p.rows) * p.cols * dt_size(dt));
      const size_t n = write_rows_host({p}, dt, buf.data());
      CK(cudaMemcpy(dst, buf.data(), n, cudaMemcpyHostToDevice));
      dst += n;
    }
    bytes_total += int64_t(m.bytes());
    return m;
  }

  // The device layout of a layer's quantised experts (all like `e`), or an
  // Error naming the layer where the kernels cannot take them.
  QExpert quant_layout(const FfnExpert& e, const std::string& where) const {
    const Matrix& g = e.gate;
    const int bits = quant_bits(g.quant), H = int(c.hidden_size), I = int(c.moe_intermediate);
    const int epc = 128 / bits;  // columns per 16-byte load (quant_experts.cuh)
    if (H % epc != 0 || I % epc != 0 || g.group % 8 != 0)
      fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where + "experts in " + quant_name(g.quant) +
                                                  " with hidden size " + std::to_string(H) + " and expert size " +
                                                  std::to_string(I) + " (need multiples of " + std::to_string(epc) +
                                                  ", groups of a multiple of 8)");
    return make_qexpert(bits, g.group, H, I);
  }
  // Expert e's gate/up block (part 0) or down block (1) in the layout q, at dst.
  static void write_quant(const FfnExpert& e, int part, const QExpert& q, const std::string& where, uint8_t* dst) {
    auto put = [&](const Matrix& m, size_t w, size_t sc, size_t bi) {
      if (quant_bits(m.quant) != q.bits || m.group != q.group)
        fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where + "experts differ in quantisation");
      std::memcpy(dst + w, m.data, m.nbytes());
      std::memcpy(dst + sc, m.scales, m.scale_bytes());
      std::memcpy(dst + bi, m.biases, m.scale_bytes());
    };
    if (part == 0) {
      put(e.gate, 0, q.gate_s, q.gate_b);
      put(e.up, q.up_w, q.up_s, q.up_b);
    } else {
      put(e.down, 0, q.dn_s, q.dn_b);
    }
  }

  // Expert pointer table of a layer whose experts are contiguous in VRAM.
  const void* const* contiguous_table(const void* base, int E, size_t stride, const std::string& what) {
    std::vector<const void*> t(static_cast<size_t>(E), nullptr);
    for (int e = 0; e < E; ++e) t[size_t(e)] = static_cast<const uint8_t*>(base) + size_t(e) * stride;
    void* d = alloc(t.size() * sizeof(void*), what);
    CK(cudaMemcpy(d, t.data(), t.size() * sizeof(void*), cudaMemcpyHostToDevice));
    return static_cast<const void* const*>(d);
  }

  // Slots per MoE layer for the routed experts in a budget of gb (or a
  // fraction of all expert bytes); E (all) when neither is given.
  int expert_slots(int64_t expert_bytes, int64_t moe, double gb, double fraction) const {
    const int64_t E = c.num_experts;
    if (E <= 0 || moe == 0) return int(E);
    double budget;
    if (gb >= 0) budget = gb * 1e9;
    else if (fraction >= 0) budget = fraction * double(E * moe * expert_bytes);
    else return int(E);
    const int64_t slots = int64_t(budget / double(moe * expert_bytes));
    return int(std::clamp<int64_t>(slots, 0, E));
  }

  // Creates the tiered cache when the routed experts (gu + dn bytes each) do
  // not all get VRAM.
  bool make_tiers(size_t gu, size_t dn, int moe) {
    const int64_t E = c.num_experts;
    const int slots = expert_slots(int64_t(gu + dn), moe, opts.expert_cache_gb, opts.expert_cache_fraction);
    if (slots >= E) return false;
    const int host = expert_slots(int64_t(gu + dn), moe, opts.host_cache_gb, opts.host_cache_fraction);
    if (host < int(c.num_experts_per_tok))
      fail("--gpu-host-cache: " + std::to_string(host) + " experts per layer in host memory, fewer than the " +
           std::to_string(c.num_experts_per_tok) + " one token uses; give it more");
    tiers = std::make_unique<ExpertTiers>(moe, int(E), gu, dn, slots, host);
    bytes_total += int64_t(tiers->vram_bytes());
    if (tiers->disk()) {
      // Experts come from disk between the router and the expert kernels: the
      // step waits for the host there, so no graph, no pick inside gate_up or
      // the output projection, no row pointers resolved before the tables are
      // final. Prompts go in chunks whose choices fit the host slots.
      disk = true;
      use_graph = false;
      opts.decode.pick_in_kernels = false;
    }
    return true;
  }

  // Disk tier, after the routing of MoE layer d: the chosen experts resident
  // (read from disk where needed) before its expert kernels.
  bool disk = false;
  std::vector<int64_t> disk_layers;  // model layer of each MoE layer (the loader's store requests)
  void disk_fetch(int mi) {
    const int k = int(c.num_experts_per_tok);
    fetch_experts(mi, eids, k);
    pdl_next = false;  // the expert kernels start after the table updates, not during them
  }
  // The n expert ids at d_ids (device) of MoE layer mi resident, tables set on the stream.
  void fetch_experts(int mi, const int* d_ids, int n) {
    CK(cudaMemcpyAsync(pinned_eids, d_ids, size_t(n) * 4, cudaMemcpyDeviceToHost, stream));
    CK(cudaStreamSynchronize(stream));
    tiers->ensure(stream, mi, pinned_eids, n);
  }

  void init_device() {
    std::string why;
    if (!CudaModel::available(&why)) fail_device(DeviceFailure::Unavailable, "no usable CUDA device: " + why);
    chunk = std::clamp(opts.decode.prefill_chunk, 1, kRing - 1);
    CK(cudaSetDevice(dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // The opt-in limit covers static shared memory too (the reductions use a little).
    const int big = int(prop.sharedMemPerBlockOptin) - 4096;
    CK(cudaFuncSetAttribute(matvec_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
    CK(cudaFuncSetAttribute(matvec_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
    CK(cudaFuncSetAttribute(matvec_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
    CK(cudaFuncSetAttribute(gate_up_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
    CK(cudaFuncSetAttribute(gate_up_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
    CK(cudaFuncSetAttribute(gate_up_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  }

  // Scratch buffers and constants, once the dimensions are known.
  void init_common() {
    const ModelConfig& m = c;
    if (m.num_experts > 512) fail_device(DeviceFailure::Unsupported, "CUDA backend: more than 512 experts is not supported");
    if (m.num_experts_per_tok > 32) fail_device(DeviceFailure::Unsupported, "CUDA backend: top-k above 32 is not supported");
    if (m.num_kv_heads > 0 && (m.num_heads % m.num_kv_heads) != 0) fail_device(DeviceFailure::Unsupported, "CUDA backend: heads not a multiple of kv heads");
    std::vector<float> inv = plan.rope_inv_freq;
    if (inv.empty()) inv.push_back(0.f);  // no rotary dims: a valid pointer all the same
    inv_freq = upload_vec(inv, "rotary frequencies");
    ones = upload_vec({1.0f, 1.0f}, "constants");
    int proj_rows = 1;
    for (const DLayer& l : L) proj_rows = std::max({proj_rows, l.lin_in.rows, l.qkv.rows});
    const int64_t H = m.hidden_size;
    x = alloc_f(size_t(H), "activations");
    proj = alloc_f(size_t(proj_rows), "activations");
    convout = alloc_f(size_t(std::max<int64_t>(1, m.lin_conv_dim())), "activations");
    const int64_t O = std::max<int64_t>({1, m.lin_num_v_heads * m.lin_v_dim, m.num_heads * m.head_dim});
    cat = alloc_f(size_t(H + O), "activations");
    lin_o = cat + H;  // a layer is linear or full: the two never live at once
    q = alloc_f(size_t(std::max<int64_t>(1, m.num_heads * m.head_dim)), "activations");
    attn_o = cat + H;
    if (opts.decode.pick_in_kernels) fold_routers();
    rlogits = alloc_f(size_t(m.num_experts + 1), "router logits");
    ew = alloc_f(size_t(m.num_experts_per_tok + 1), "expert weights");
    eids = static_cast<int*>(alloc(size_t(m.num_experts_per_tok + 1) * 4, "expert ids"));
    maxI = int(std::max({m.moe_intermediate, m.shared_intermediate, m.intermediate_size, int64_t(1)}));
    hb = alloc_f(size_t(m.num_experts_per_tok + 1) * maxI, "expert activations");
    logits = alloc_f(size_t(m.vocab_size), "logits");
    sel = static_cast<const void**>(alloc(size_t(2 * std::max<int64_t>(1, m.num_experts_per_tok)) * sizeof(void*),
                                          "expert selection"));
    presel_done = static_cast<unsigned*>(alloc(4, "router counter"));
    presel_w = alloc_f(size_t(m.num_experts_per_tok + 1), "expert weights");
    CK(cudaMemset(presel_done, 0, 4));
    CK(cudaMemset(eids, 0, size_t(m.num_experts_per_tok + 1) * 4));
    CK(cudaMemset(ew, 0, size_t(m.num_experts_per_tok + 1) * 4));
    CK(cudaMallocHost(&pinned_logits, size_t(m.vocab_size) * 4));
    CK(cudaMallocHost(&pinned_ids, size_t(kRing) * 4));
    // Disk tier: one token's choices, or a prefill chunk's (at most as many as host slots, so at most E).
    CK(cudaMallocHost(&pinned_eids, size_t(std::max<int64_t>(1, std::max(m.num_experts_per_tok, m.num_experts))) * 4));
    // Bytes one decoded token reads: everything but the unrouted experts.
    bytes_per_token = int64_t(lm_head.bytes()) + int64_t(embed.cols) * int64_t(dt_size(embed.dt));
    for (const LayerPlan& lp : plan.layers) {
      const DLayer& l = L[size_t(lp.index)];
      // The checkpoint's bytes (the roofline's numerator): a folded router
      // reads its fp32 fold instead, more bytes, not counted here.
      bytes_per_token += int64_t(l.lin_in.bytes() + l.out_proj.bytes() + l.qkv.bytes() + l.o_proj.bytes() +
                                 l.router.bytes() + l.s_gu.bytes() + l.s_down.bytes());
      if (lp.ffn == FfnKind::RoutedMoE)
        bytes_per_token += int64_t(m.num_experts_per_tok) *
                           (l.q.bits ? int64_t(l.q.gu_bytes + l.q.dn_bytes)
                                     : 3 * m.moe_intermediate * m.hidden_size * int64_t(dt_size(l.edt)));
    }
  }

  void mark(int cls) {
    check(cudaGetLastError(), kClassNames[cls]);
    if (!profiling) return;
    const size_t i = event_class.size();
    if (events.size() <= i) {
      cudaEvent_t e;
      CK(cudaEventCreate(&e));
      events.push_back(e);
    }
    CK(cudaEventRecord(events[i], stream));
    event_class.push_back(cls);
  }

  // Launch with programmatic stream serialization (PDL), except where the
  // previous operation in the stream is not a kernel of this step.
  bool pdl_next = false;  // set after the first kernel of a step
  int cluster_next = 1;   // blocks per cluster of the next go() (then back to 1)
  template <typename... K, typename... A>
  void go(void (*kern)(K...), dim3 grid, dim3 block, size_t smem, A... args) {
    const int cl = cluster_next;
    cluster_next = 1;
    launch(kern, grid, block, smem, cl, args...);
  }
  template <typename... K, typename... A>
  void launch(void (*kern)(K...), dim3 grid, dim3 block, size_t smem, int cl, A... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[2];
    int n = 0;
    if (pdl_next) {
      at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      at[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cl > 1) {
      at[n].id = cudaLaunchAttributeClusterDimension;
      at[n++].val.clusterDim = {unsigned(cl), 1, 1};
    }
    cfg.attrs = at;
    cfg.numAttrs = n;
    check(cudaLaunchKernelEx(&cfg, kern, args...), "cudaLaunchKernelEx");
    pdl_next = true;
  }

  // Warps per row: enough warps in flight for matrices of few rows.
  int split_for(int rows, int cols, int vec) const {
    const int target = prop.multiProcessorCount * 48;
    int s = 1;
    while (s < kWarps && rows * s < target && cols % (2 * s * vec) == 0) s *= 2;
    return s;
  }

  // Rows per warp to prefetch before a row kernel's wait: all of them when
  // the whole matrix fits in half the L2, else as many as do (at least one).
  int pf_rows(size_t bytes, int rows, int blocks, int rpb) const {
    const int per_warp = (rows + blocks * rpb - 1) / (blocks * rpb);
    const size_t half = size_t(prop.l2CacheSize) / 2, row = bytes / size_t(std::max(rows, 1));
    const size_t fit = half / std::max<size_t>(1, row * size_t(blocks) * rpb);
    return int(std::clamp<size_t>(fit, 1, size_t(per_warp)));
  }

  // Blocks per SM for a row kernel: kBlocksPerSm, or fewer when that many do
  // not fit (registers, shared memory), so the grid is one resident wave.
  struct Fit {
    const void* func;
    size_t smem;
    int threads, n;
  };
  std::vector<Fit> fit_cache;
  int per_sm(const void* func, size_t smem, int threads = kThreads) {
    for (const Fit& f : fit_cache)
      if (f.func == func && f.smem == smem && f.threads == threads) return f.n;
    int n = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, func, threads, smem));
    n = std::clamp(n, 1, kBlocksPerSm);
    fit_cache.push_back({func, smem, threads, n});
    return n;
  }

  void matvec(const DMat& W, const float* xin, const float* nw, float* y, int acc, int cls, float* xcopy = nullptr) {
    const int split = split_for(W.rows, W.cols, int(16 / dt_size(W.dt)));
    const int rpb = kWarps / split;
    const void* fn = W.dt == DT_F32   ? reinterpret_cast<const void*>(matvec_kernel<float>)
                     : W.dt == DT_F16 ? reinterpret_cast<const void*>(matvec_kernel<__half>)
                                      : reinterpret_cast<const void*>(matvec_kernel<__nv_bfloat16>);
    const size_t smem = nw ? size_t(W.cols) * 4 : 0;  // a normed x is staged in shared memory
    const int blocks = std::min((W.rows + rpb - 1) / rpb, prop.multiProcessorCount * per_sm(fn, smem));
    const int pf = pf_rows(W.bytes(), W.rows, blocks, rpb);
    const float eps = c.rms_norm_eps;
    const int per_warp = (W.rows + blocks * rpb - 1) / (blocks * rpb);
    // 2 rows per warp at a time; 3 where the grid leaves exactly 3 per warp
    // (one batch of loads instead of 2 + 1).
    const int rows = opts.decode.force_three_rows || per_warp == 3 ? 3 : 2;
    switch (W.dt) {
      case DT_F32:
        go(matvec_kernel<float>, blocks, kThreads, smem, static_cast<const float*>(W.p), W.rows, W.cols, xin, nw, eps,
           y, acc, split, pf, rows, xcopy);
        break;
      case DT_F16:
        go(matvec_kernel<__half>, blocks, kThreads, smem, static_cast<const __half*>(W.p), W.rows, W.cols, xin, nw,
           eps, y, acc, split, pf, rows, xcopy);
        break;
      default:
        go(matvec_kernel<__nv_bfloat16>, blocks, kThreads, smem, static_cast<const __nv_bfloat16*>(W.p), W.rows,
           W.cols, xin, nw, eps, y, acc, split, pf, rows, xcopy);
    }
    mark(cls);
  }

  // x += W_out . o and the folded router's logits, one launch (outproj_router_kernel).
  void outproj_router(const DLayer& d, const DMat& W) {
    OutRouterArgs a;
    a.cat = cat;
    a.x = x;
    a.R = d.rfold;
    a.logits = rlogits;
    a.H = W.rows;
    a.O = W.cols;
    a.rowsR = d.router.rows;
    a.E = int(c.num_experts);
    a.k = int(c.num_experts_per_tok);
    a.ids = eids;
    a.wscratch = presel_w;
    a.tc = d.tc;
    a.sel = ExpertSel{d.gu_tab, d.down_tab, sel};
    a.done = presel_done;
    a.splitA = split_for(W.rows, W.cols, int(16 / dt_size(W.dt)));
    a.splitR = split_for(a.rowsR, a.H + a.O, 4);
    const void* fn = W.dt == DT_F32   ? reinterpret_cast<const void*>(outproj_router_kernel<float>)
                     : W.dt == DT_F16 ? reinterpret_cast<const void*>(outproj_router_kernel<__half>)
                                      : reinterpret_cast<const void*>(outproj_router_kernel<__nv_bfloat16>);
    // Router blocks first (they start at once); the projection gets what is
    // left of one resident wave, at least one block per SM.
    const int rpbR = kWarps / a.splitR, rpbA = kWarps / a.splitA, sms = prop.multiProcessorCount;
    int resident = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fn, kThreads, 0));
    resident = std::max(resident, 1) * sms;
    a.nbR = (a.rowsR + rpbR - 1) / rpbR;
    a.nbA = std::min((a.H + rpbA - 1) / rpbA, std::max(sms, std::min(sms * kBlocksPerSm, resident - a.nbR)));
    const int blocks = a.nbR + a.nbA;
    switch (W.dt) {
      case DT_F32: go(outproj_router_kernel<float>, blocks, kThreads, 0, static_cast<const float*>(W.p), a); break;
      case DT_F16: go(outproj_router_kernel<__half>, blocks, kThreads, 0, static_cast<const __half*>(W.p), a); break;
      default:
        go(outproj_router_kernel<__nv_bfloat16>, blocks, kThreads, 0, static_cast<const __nv_bfloat16*>(W.p), a);
    }
    mark(K_OUT);
  }

  // Folds each MoE layer's router into its output projection's launch where
  // the shapes allow (see outproj_router_kernel); other layers keep the router.
  template <typename T>
  void fold_router(DLayer& d, const DMat& out) {
    const int H = int(c.hidden_size), O = out.cols, rows = d.router.rows;
    d.rfold = static_cast<float*>(alloc(size_t(rows) * (H + O) * 4, "folded router"));
    bytes_total += int64_t(rows) * (H + O) * 4;
    const dim3 grid(std::max(1, std::min(64, (H + O + 255) / 256)), rows);
    fold_router_kernel<T><<<grid, 256, 0, stream>>>(static_cast<const T*>(d.router.p), rows, d.post_norm,
                                                   static_cast<const T*>(out.p), H, O, d.rfold);
    check(cudaGetLastError(), "fold_router_kernel");
  }
  void fold_routers() {
    const int H = int(c.hidden_size);
    for (const LayerPlan& l : plan.layers) {
      DLayer& d = L[size_t(l.index)];
      const DMat& out = l.mixer == MixerKind::GatedAttention ? d.o_proj : d.out_proj;
      // Quantised experts' gate_up cannot pick (quant_experts.cuh); with the
      // fold the pick is the output projection's (outproj_router_kernel).
      if (l.ffn != FfnKind::RoutedMoE || !d.router.p || !d.post_norm || !out.p || out.rows != H || d.router.cols != H ||
          out.dt != d.router.dt || H % 4 != 0 || out.cols % 4 != 0)
        continue;
      switch (out.dt) {
        case DT_F32: fold_router<float>(d, out); break;
        case DT_F16: fold_router<__half>(d, out); break;
        default: fold_router<__nv_bfloat16>(d, out);
      }
    }
    CK(cudaStreamSynchronize(stream));
  }

  // Router logits, then the top-k kernel unless gate_up picks (pick_in_kernels, bf16 experts).
  void route(const DLayer& d) {
    const bool pick = opts.decode.pick_in_kernels;
    matvec(d.router, x, d.post_norm, rlogits, 0, K_ROUTER);
    if (pick && !d.q.bits) return;  // gate_up does the top-k
    const ExpertSel es{d.gu_tab, d.down_tab, pick ? sel : nullptr};
    go(topk_kernel, 1, 32, 0, rlogits, int(c.num_experts), int(c.num_experts_per_tok), c.norm_topk_prob ? 1 : 0,
       d.has_shared ? 1 : 0, eids, ew, d.tc, es);
    mark(K_ROUTER);
  }

  // Blocks per query head in attn_kernel (a cluster, each a slice of the
  // positions): one per 256 positions of KV capacity, 1 to 8, so a long
  // context is read by up to 8x as many SMs. (One per 1024 left a 2048
  // window or h2o budget on 2 blocks per head: 10% slower than a full cache
  // twice as long at 8.) The graph is captured per capacity (ensure_cap
  // drops it), so this follows the cache.
  int attn_blocks(int cap, int hd) const {
    using Split = DecodeOptions::AttentionSplit;
    const Split mode = opts.decode.attention_split;
    if (hd % 8 || hd > 256 || mode == Split::Off) return 1;  // attn_kernel's vec path only
    if (mode == Split::Force) return 4;  // tests
    return std::clamp(cap / 256, 1, 8);
  }

  // The delta step on delta2_kernel (a cluster of blocks per head) where
  // its shapes allow; false: the caller launches delta_kernel.
  bool delta_cluster(const DeltaArgs& a) {
    int cpb = opts.decode.force_small_delta_clusters ? 8 : 32;  // 8 (tests): clusters even on small heads
    if (a.dv % cpb || a.dv / cpb > 8) cpb = 32;
    if (a.dv % cpb || a.dv / cpb > 8) return false;
    cluster_next = a.dv / cpb;
    const dim3 grid(a.nv * (a.dv / cpb));
    auto run = [&](auto kern, int threads) { go(kern, grid, threads, 0, a); };
    if (cpb == 32) {
      if (a.dk == 128) run(delta2_kernel<128, 32, 8>, 256);
      else if (a.dk == 64) run(delta2_kernel<64, 32, 8>, 256);
      else if (a.dk == 32) run(delta2_kernel<32, 32, 8>, 256);
      else return cluster_next = 1, false;
    } else {
      if (a.dk == 128) run(delta2_kernel<128, 8, 8>, 64);
      else if (a.dk == 64) run(delta2_kernel<64, 8, 8>, 64);
      else if (a.dk == 32) run(delta2_kernel<32, 8, 8>, 64);
      else return cluster_next = 1, false;
    }
    return true;
  }

  template <typename T>
  void moe_launch(const MoeArgs& a, int slots) {
    dim3 g1((a.maxI + kWarps - 1) / kWarps, slots);
    go(gate_up_kernel<T>, g1, kThreads, size_t(a.H) * 4, a);
    mark(K_EXPERTS);
    if (slots >= 2 && slots <= kDown2MaxSlots) {
      // 8 rows per warp when that grid is one resident wave (the 35B: 256
      // blocks of 9 warps, 2 per SM), else 4 (fewer registers per thread).
      auto waves = [&](const void* fn, int R) {
        const int blocks = (a.H + R - 1) / R, resident = per_sm(fn, 0, slots * 32) * prop.multiProcessorCount;
        return (blocks + resident - 1) / resident;
      };
      const bool r8 = waves(reinterpret_cast<const void*>(down2_kernel<T, 8>), 8) <=
                      waves(reinterpret_cast<const void*>(down2_kernel<T, 4>), 4);
      // down_early_kernel: the rows in registers before the wait when the pick
      // was final two kernels back (not made by gate_up itself).
      const int ch = (std::max(a.I, a.Is) * int(sizeof(T)) + 511) / 512;  // 16-byte chunks per lane and row
      const int early = !a.logits || a.presel ? 1 : 0;
      if (r8 && ch == 1) go(down_early_kernel<T, 8, 1>, (a.H + 7) / 8, slots * 32, 0, a, early);
      else if (r8 && ch == 2) go(down_early_kernel<T, 8, 2>, (a.H + 7) / 8, slots * 32, 0, a, early);
      else if (!r8 && ch <= 4) go(down_early_kernel<T, 4, 4>, (a.H + 3) / 4, slots * 32, 0, a, early);
      else if (r8) go(down2_kernel<T, 8>, (a.H + 7) / 8, slots * 32, 0, a);
      else go(down2_kernel<T, 4>, (a.H + 3) / 4, slots * 32, 0, a);
      mark(K_EXPERTS);
      return;
    }
    int split = 1;
    while (split * 2 <= std::min(slots, kWarps)) split *= 2;
    const int rpb = kWarps / split;
    const int blocks = std::min((a.H + rpb - 1) / rpb, prop.multiProcessorCount * kBlocksPerSm);
    MoeArgs b = a;
    b.pf_rows = pf_rows(size_t(slots) * a.H * std::max(a.I, a.Is) * sizeof(T), a.H, blocks, rpb);
    go(down_kernel<T>, blocks, kThreads, 0, b, split);
    mark(K_EXPERTS);
  }

  // The experts of a layer of quantised experts (shared expert in storage type sdt).
  template <int BITS>
  void moe_launch_q(const MoeArgs& a, int slots, const QExpert& q, int sdt) {
    const int blocks = std::min((a.H + kWarps - 1) / kWarps, prop.multiProcessorCount * kBlocksPerSm);
    // gate_up: x, its chunk-major copy and 8-column sums; down: the routed
    // slots' h, chunk-major, and sums (stage_chunks).
    const size_t s1 = size_t(a.H) * 4 * 2 + size_t(a.H) / 8 * 4, s2 = size_t(a.k) * a.I * 4 + size_t(a.k) * a.I / 8 * 4;
    auto run = [&](auto gu, auto dn) {
      if (s1 > 48 * 1024) CK(cudaFuncSetAttribute(gu, cudaFuncAttributeMaxDynamicSharedMemorySize, int(s1)));
      if (s2 > 48 * 1024) CK(cudaFuncSetAttribute(dn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(s2)));
      // One resident wave (a second one pays gate_up's whole chain again):
      // warps take several rows where the grid would not fit.
      const int resident = per_sm(reinterpret_cast<const void*>(gu), s1) * prop.multiProcessorCount;
      const dim3 g1(std::max(1, std::min((a.maxI + kWarps - 1) / kWarps, resident / slots)), slots);
      go(gu, g1, kThreads, s1, a, q);
      mark(K_EXPERTS);
      go(dn, blocks, kThreads, s2, a, q);
      mark(K_EXPERTS);
    };
    switch (sdt) {
      case DT_F32: run(gate_up_q_kernel<BITS, float>, down_q_kernel<BITS, float>); break;
      case DT_F16: run(gate_up_q_kernel<BITS, __half>, down_q_kernel<BITS, __half>); break;
      default: run(gate_up_q_kernel<BITS, __nv_bfloat16>, down_q_kernel<BITS, __nv_bfloat16>);
    }
  }
  void moe_launch_q(const MoeArgs& a, int slots, const QExpert& q, int sdt) {
    if (q.bits == 8) moe_launch_q<8>(a, slots, q, sdt);
    else moe_launch_q<4>(a, slots, q, sdt);
  }

  // A GatedDeltaNet layer's mixer (state slot sl): in-proj (input norm
  // fused), conv1d, the delta-rule step, out-proj (+ the folded router).
  void delta_net(CudaState::Impl& s, const DLayer& d, int sl) {
    const ModelConfig& m = c;
    const int nk = int(m.lin_num_k_heads), nv = int(m.lin_num_v_heads), dk = int(m.lin_k_dim), dv = int(m.lin_v_dim);
    const int C = int(m.lin_conv_dim()), K = int(m.conv_kernel);
    matvec(d.lin_in, x, d.in_norm, proj, 0, K_PROJ, d.rfold ? cat : nullptr);
    go(conv_kernel, (C + 255) / 256, 256, 0, proj, C, K, d.conv_w, s.conv[size_t(sl)], convout);
    mark(K_CONV);
    DeltaArgs a;
    a.conv = convout;
    a.proj = proj;
    a.zoff = C;
    a.boff = C + nv * dv;
    a.aoff = C + nv * dv + nv;
    a.dt_bias = d.dt_bias;
    a.neg_exp_A = d.neg_exp_A;
    a.norm_w = d.gnorm;
    a.S = s.ssm[size_t(sl)];
    a.out = lin_o;
    a.nk = nk;
    a.nv = nv;
    a.dk = dk;
    a.dv = dv;
    a.eps = m.rms_norm_eps;
    const size_t smem = size_t(2 * dk) * 4;
    auto th = [&](int split) { return std::min(1024, std::max(32, (dv * split + 31) / 32 * 32)); };
    if (!delta_cluster(a)) {
      if (dk == 128 && dv * 4 <= 1024) go(delta_kernel<128, 4>, nv, th(4), smem, a);
      else if (dk == 64 && dv * 2 <= 1024) go(delta_kernel<64, 2>, nv, th(2), smem, a);
      else if (dk == 32) go(delta_kernel<32, 1>, nv, th(1), smem, a);
      else go(delta_kernel<0, 1>, nv, th(1), smem, a);
    }
    mark(K_DELTA);
    if (d.rfold) outproj_router(d, d.out_proj);
    else matvec(d.out_proj, lin_o, nullptr, x, 1, K_OUT);
  }

  // A gated attention layer's mixer (KV cache sl): q/k/v projection (input
  // norm fused), rope + KV store, attention, h2o's scores, o_proj (+ the
  // folded router).
  void attention(CudaState::Impl& s, const DLayer& d, int sl) {
    const ModelConfig& m = c;
    const int nh = int(m.num_heads), nkv = int(m.num_kv_heads), hd = int(m.head_dim);
    matvec(d.qkv, x, d.in_norm, proj, 0, K_PROJ, d.rfold ? cat : nullptr);
    const AttnPrepArgs p = attn_prep_args(m, d, proj, q, s.d_pos, inv_freq, s.kvl[size_t(sl)], s.ns, s.kvt);
    go(attn_prep_kernel, nh + 1, 128, size_t(std::max(hd, 2 * nkv * hd)) * 4, p);
    mark(K_ATTN);
    AttnArgs a;
    a.q = q;
    a.gate = proj;
    a.scores = s.scores;
    a.out = attn_o;
    a.pos = s.d_pos;
    a.kv = s.kvl[size_t(sl)];
    a.nh = nh;
    a.nkv = nkv;
    a.hd = hd;
    a.ns = s.ns;
    a.scale = 1.0f / std::sqrt(float(hd));
    a.prefetch = 1;
    const int groups = std::max(8, 256 / hd);  // 8: the warps' partials (attn_kernel)
    const size_t smem = size_t(2 * hd + groups * hd) * 4;
    a.split = attn_blocks(s.cap, hd);
    cluster_next = a.split;
    switch (s.kvt) {
      case KV_F32: go(attn_kernel<KV_F32>, nh * a.split, 256, smem, a); break;
      case KV_BF16: go(attn_kernel<KV_BF16>, nh * a.split, 256, smem, a); break;
      case KV_F16: go(attn_kernel<KV_F16>, nh * a.split, 256, smem, a); break;
      default: go(attn_kernel<KV_FP8>, nh * a.split, 256, smem, a); break;
    }
    mark(K_ATTN);
    if (s.h2o) {
      go(h2o_acc_kernel, (s.cap + 127) / 128, 128, 0, s.kvl[size_t(sl)], s.scores, nh, s.d_pos);
      mark(K_ATTN);
    }
    if (d.rfold) outproj_router(d, d.o_proj);
    else matvec(d.o_proj, attn_o, nullptr, x, 1, K_OUT);
  }

  // The feed-forward's arguments common to routed and dense layers.
  MoeArgs ffn_args(const DLayer& d) const {
    MoeArgs a{};
    a.H = int(c.hidden_size);
    a.maxI = maxI;
    a.norm_w = d.post_norm;
    a.eps = c.rms_norm_eps;
    a.x = x;
    a.hb = hb;
    a.ids = eids;
    a.sel = nullptr;
    return a;
  }

  // The expert kernels of a feed-forward of `slots` slots, by storage type.
  void ffn_launch(const DLayer& d, const MoeArgs& a, int slots) {
    if (d.q.bits) {
      moe_launch_q(a, slots, d.q, d.edt);
      return;
    }
    switch (d.edt) {
      case DT_F32: moe_launch<float>(a, slots); break;
      case DT_F16: moe_launch<__half>(a, slots); break;
      default: moe_launch<__nv_bfloat16>(a, slots); break;
    }
  }

  // A routed MoE (MoE layer mi): routing (unless folded into the output
  // projection), the disk tier's reads, the top-k experts + shared expert.
  void routed_moe(const DLayer& d, int mi) {
    const ModelConfig& m = c;
    const bool pick = opts.decode.pick_in_kernels;
    MoeArgs a = ffn_args(d);
    a.sel = pick ? sel : nullptr;
    if (!d.rfold) route(d);  // else the logits came with the output projection
    if (disk) disk_fetch(mi);
    a.gu_tab = d.gu_tab;
    a.down_tab = d.down_tab;
    a.k = int(m.num_experts_per_tok);
    a.I = int(m.moe_intermediate);
    a.w = ew;
    a.has_shared = d.has_shared ? 1 : 0;
    a.s_gu = d.s_gu.p;
    a.s_down = d.s_down.p;
    a.Is = d.has_shared ? d.s_down.cols : 0;
    const int slots = a.k + a.has_shared;
    if (pick && (!d.q.bits || d.rfold)) {
      a.logits = rlogits;
      a.E = int(m.num_experts);
      a.norm_topk = m.norm_topk_prob ? 1 : 0;
      a.tc = d.tc;
      a.tsel = ExpertSel{d.gu_tab, d.down_tab, sel};
      a.ids_out = eids;
      a.w_out = ew;
      a.sel = sel;
      a.folded = d.rfold ? 1 : 0;
      a.presel = d.rfold ? 1 : 0;
    }
    ffn_launch(d, a, slots);
  }

  // A dense SwiGLU MLP: the expert kernels with one slot (weight 1).
  void dense_mlp(const DLayer& d) {
    MoeArgs a = ffn_args(d);
    a.gu_tab = nullptr;
    a.down_tab = nullptr;
    a.k = 0;
    a.I = 0;
    a.w = ones;
    a.has_shared = 1;
    a.s_gu = d.s_gu.p;
    a.s_down = d.s_down.p;
    a.Is = d.s_down.cols;
    ffn_launch(d, a, 1);
  }

  // One token through the model. kind 0: no logits; 1: logits; 2: logits + argmax.
  void enqueue_step(CudaState::Impl& s, int kind) {
    const ModelConfig& m = c;
    const int H = int(m.hidden_size);
    pdl_next = false;
    switch (embed.dt) {
      case DT_F32:
        go(embed_kernel<float>, (H + 255) / 256, 256, 0, static_cast<const float*>(embed.p), H, s.d_ids,
                                                                 s.d_pos, s.d_base, kRing, x);
        break;
      case DT_F16:
        go(embed_kernel<__half>, (H + 255) / 256, 256, 0, static_cast<const __half*>(embed.p), H, s.d_ids,
                                                                  s.d_pos, s.d_base, kRing, x);
        break;
      default:
        go(embed_kernel<__nv_bfloat16>, (H + 255) / 256, 256, 0, 
            static_cast<const __nv_bfloat16*>(embed.p), H, s.d_ids, s.d_pos, s.d_base, kRing, x);
    }
    mark(K_EMBED);
    for (const LayerPlan& l : plan.layers) {
      const DLayer& d = L[size_t(l.index)];
      switch (l.mixer) {
        case MixerKind::GatedDeltaNet: delta_net(s, d, l.state_slot); break;
        case MixerKind::GatedAttention: attention(s, d, l.state_slot); break;
      }
      switch (l.ffn) {
        case FfnKind::RoutedMoE: routed_moe(d, l.moe_slot); break;
        case FfnKind::DenseSwiGLU: dense_mlp(d); break;
      }
    }
    if (kind >= 1) matvec(lm_head, x, final_norm, logits, 0, K_LMHEAD);
    if (kind == 2) {
      go(argmax_kernel, 1, 1024, 0, logits, int(m.vocab_size), s.d_ids, s.d_pos, s.d_base, kRing, s.d_out,
         s.d_step, static_cast<const char*>(embed.p), size_t(H) * dt_size(embed.dt));
      mark(K_ARGMAX);
    }
    go(advance_kernel, 1, 1, 0, s.d_pos, s.d_step);
    check(cudaGetLastError(), "advance");
  }

  void run_step(CudaState::Impl& s, int kind) {
    if (!use_graph || profiling) {
      enqueue_step(s, kind);
      return;
    }
    if (!s.graphs[kind]) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      try {
        enqueue_step(s, kind);
      } catch (...) {
        cudaStreamEndCapture(stream, &g);
        cudaGetLastError();
        throw;
      }
      CK(cudaStreamEndCapture(stream, &g));
      cudaError_t e = cudaGraphInstantiate(&s.graphs[kind], g, 0);
      cudaGraphDestroy(g);
      check(e, "cudaGraphInstantiate");
    }
    CK(cudaGraphLaunch(s.graphs[kind], stream));
  }

  // Full retention: grow the KV storage (and scores) to hold `slots`.
  void ensure_cap(CudaState::Impl& s, int64_t slots) {
    if (s.window > 0 || s.h2o || slots <= s.cap) return;
    int64_t nc = std::max<int64_t>(int64_t(s.cap) * 2, slots);
    nc = (nc + 255) / 256 * 256;
    if (nc > (int64_t(1) << 30)) fail_device(DeviceFailure::Unsupported, "CUDA backend: context too long (2^30 positions)");
    s.drop_graphs();
    const size_t row = size_t(s.nkv) * s.hd;
    for (KvLayer& l : s.kvl) {
      KvLayer n = l;
      n.cap = int(nc);
      n.k = dev_alloc(size_t(nc) * row * s.el, "KV cache");
      n.v = dev_alloc(size_t(nc) * row * s.el, "KV cache");
      n.ks = static_cast<float*>(dev_alloc(size_t(nc) * std::max(s.ns, 1) * 4, "KV scales"));
      n.vs = static_cast<float*>(dev_alloc(size_t(nc) * std::max(s.ns, 1) * 4, "KV scales"));
      const size_t used = size_t(std::min<int64_t>(s.pos, s.cap));
      if (used) {
        CK(cudaMemcpy(n.k, l.k, used * row * s.el, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(n.v, l.v, used * row * s.el, cudaMemcpyDeviceToDevice));
        if (s.ns) {
          CK(cudaMemcpy(n.ks, l.ks, used * s.ns * 4, cudaMemcpyDeviceToDevice));
          CK(cudaMemcpy(n.vs, l.vs, used * s.ns * 4, cudaMemcpyDeviceToDevice));
        }
      }
      for (void* p : {l.k, l.v, static_cast<void*>(l.ks), static_cast<void*>(l.vs)}) cudaFree(p);
      l = n;
    }
    cudaFree(s.scores);
    s.scores = static_cast<float*>(dev_alloc(size_t(nc) * std::max(s.nh, 1) * 4, "attention scores"));
    s.cap = int(nc);
  }

  // The batched prefill, made at its first use; null where it cannot run
  // (switched off, shapes it does not cover, no device memory left for its
  // buffers): token by token then.
  Prefill* batched() {
    if (prefill_tried) return prefill.get();
    prefill_tried = true;
    if (!opts.decode.batched_prefill) return nullptr;
    PrefillModel pm;
    pm.c = &c;
    pm.L = &L;
    pm.plan = &plan;
    pm.embed = embed;
    pm.lm_head = lm_head;
    pm.final_norm = final_norm;
    pm.inv_freq = inv_freq;
    pm.stream = stream;
    pm.profile = opts.decode.prefill_profile;
    int max_t = chunk;
    if (disk) {
      // Every expert a chunk chooses must be resident at once (host or
      // VRAM): at most T * k distinct ones, so T <= host slots / k.
      pm.experts_needed = [this](int mi, const int* d_ids, int n) { fetch_experts(mi, d_ids, n); };
      max_t = std::min(chunk, std::max(1, tiers->host_slots() / int(c.num_experts_per_tok)));
      // Chunks of 1-2 tokens lose to the decode step (coder-mini q4, pp256:
      // 2 tokens per chunk 1943 tokens/s vs 2348 token by token; 3 tokens
      // 3040 vs 2579; bench/results/cuda-disk-v2-coder-mini.txt).
      if (max_t < 3) return nullptr;
    }
    if (!Prefill::unsupported(pm).empty()) return nullptr;
    // Its buffers grow with the chunk (~0.6 GB at 2048 tokens for the 35B):
    // where the device has no room, shorter chunks.
    for (int t = max_t; !prefill && t >= std::min(max_t, 64); t /= 2) {
      try {
        prefill = std::make_unique<Prefill>(pm, t);
      } catch (const Error&) {
        prefill.reset();
      }
    }
    return prefill.get();
  }

  // Puts ids[0..n) into the device ring at positions pos.. (base = pos).
  void put_ids(CudaState::Impl& s, const int32_t* ids, int64_t n) {
    std::memcpy(pinned_ids, ids, size_t(n) * 4);
    pinned_ids[n] = int32_t(s.pos);  // base, copied separately below
    CK(cudaMemcpyAsync(s.d_ids, pinned_ids, size_t(n) * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(s.d_base, pinned_ids + n, 4, cudaMemcpyHostToDevice, stream));
  }
};

bool CudaModel::available(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = cuda_msg(e);
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  // The kernels are built for sm_90 and use Hopper instructions (programmatic
  // dependent launch): an older GPU would fail at the first launch.
  cudaDeviceProp p{};
  e = cudaGetDeviceProperties(&p, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = cuda_msg(e);
    return false;
  }
  if (p.major < 9) {
    if (why)
      *why = std::string("GPU 0 (") + p.name + ") has compute capability " + std::to_string(p.major) + "." +
             std::to_string(p.minor) + "; this build's CUDA kernels need 9.0 (Hopper) or newer";
    return false;
  }
  return true;
}

CudaModel::CudaModel() : p_(new Impl) {}
CudaModel::~CudaModel() = default;

const ModelConfig& CudaModel::config() const { return p_->c; }
std::string CudaModel::device_name() const { return p_->prop.name; }
int64_t CudaModel::weight_bytes_total() const { return p_->bytes_total; }
int64_t CudaModel::weight_bytes_per_token() const { return p_->bytes_per_token; }
void CudaModel::set_use_graph(bool on) { p_->use_graph = on && !p_->disk; }  // the disk tier waits for the host inside a step

std::unique_ptr<CudaModel> CudaModel::upload(const QwenModel& model, const CudaOptions& o) {
  std::unique_ptr<CudaModel> cm(new CudaModel);
  Impl& m = *cm->p_;
  m.c = model.config();
  m.plan = make_plan(m.c);
  m.opts = o;
  m.init_device();
  const ModelConfig& c = m.c;
  const ModelWeights& w = model.weights();
  m.embed = m.upload_rows({w.embed}, "embedding");
  m.lm_head = w.lm_head.data == w.embed.data ? m.embed : m.upload_rows({w.lm_head}, "lm_head");
  m.final_norm = m.upload_vec(w.final_norm, "final norm");
  size_t tier_gu = 0, tier_dn = 0;
  bool tiered = false;
  for (const LayerPlan& l : m.plan.layers) {
    const int64_t i = l.index;
    const LayerWeights& lw = w.layers[size_t(i)];
    const std::string p = "layer " + std::to_string(i) + " ";
    const bool attention = l.mixer == MixerKind::GatedAttention, moe = l.ffn == FfnKind::RoutedMoE;
    if (attention != (lw.kind == LayerKind::Full) || moe != lw.ffn.moe)
      fail("CUDA backend: " + p + "weights do not match the layer plan of the config");
    DLayer d;
    d.in_norm = m.upload_vec(lw.input_norm, p + "norm");
    d.post_norm = m.upload_vec(lw.post_norm, p + "norm");
    if (attention) {
      const AttentionWeights& a = lw.attn;
      d.qkv = m.upload_rows({a.q_proj, a.k_proj, a.v_proj}, p + "q/k/v projection");
      d.o_proj = m.upload_rows({a.o_proj}, p + "o_proj");
      d.q_norm = m.upload_vec(a.q_norm, p + "q_norm");
      d.k_norm = m.upload_vec(a.k_norm, p + "k_norm");
    } else {
      const LinearAttentionWeights& l = lw.lin;
      d.lin_in = m.upload_rows(l.in_proj.block_views(), p + "linear-attention projections");
      d.out_proj = m.upload_rows({l.out_proj}, p + "out_proj");
      d.conv_w = m.upload_vec(l.conv, p + "conv1d");
      d.dt_bias = m.upload_vec(l.dt_bias, p + "dt_bias");
      d.neg_exp_A = m.upload_vec(l.neg_exp_A, p + "A_log");
      d.gnorm = m.upload_vec(l.norm, p + "gated norm");
    }
    const FfnWeights& f = lw.ffn;
    if (moe) {
      const int moe_index = l.moe_slot;
      std::vector<Matrix> r = {f.router};
      if (f.has_shared) r.push_back(f.shared_gate);
      d.router = m.upload_rows(r, p + "router");
      // The routed experts come through the model's expert store: views of
      // the checkpoint, or of packed files (mmapped or streamed from disk,
      // read once here). A packed model's experts share one format; a
      // checkpoint's float experts take one storage type for the layer.
      ExpertStore& store = model.expert_store();
      const int E = int(c.num_experts), H = int(c.hidden_size), I = int(c.moe_intermediate);
      const ExpertBatch first_batch = store.fetch(i, {0});
      const FfnExpert& first = first_batch.experts.at(0);
      int dt = first.gate.quantized() ? DT_BF16 : dt_of(first.gate.dtype);
      auto same = [&](const Matrix& x) {
        if (!x.quantized() && dt_of(x.dtype) != dt) dt = DT_F32;
      };
      for (const FfnExpert& e : f.experts) same(e.gate), same(e.up), same(e.down);
      if (f.has_shared) {
        if (first.gate.quantized()) dt = storage_dt(f.shared.gate);
        same(f.shared.gate), same(f.shared.up), same(f.shared.down);
      }
      d.edt = dt;
      if (first.gate.quantized()) d.q = m.quant_layout(first, p);
      const size_t gu_bytes = d.q.bits ? d.q.gu_bytes : size_t(2 * I) * H * dt_size(dt);
      const size_t dn_bytes = d.q.bits ? d.q.dn_bytes : size_t(H) * I * dt_size(dt);
      if (moe_index == 0) tiered = m.make_tiers(gu_bytes, dn_bytes, m.plan.moe_layers);
      if (tiered && moe_index > 0 && (gu_bytes != tier_gu || dn_bytes != tier_dn))
        fail_device(DeviceFailure::Unsupported, "--gpu-expert-cache: the experts of " + p +
                                                    "have a different storage format than those of the first MoE layer");
      uint8_t *gu_dst, *dn_dst;
      bool host_dst = tiered;
      if (tiered) {
        gu_dst = m.tiers->host_gu(moe_index);
        dn_dst = m.tiers->host_down(moe_index);
        d.gu_tab = m.tiers->gu_tab(moe_index);
        d.down_tab = m.tiers->down_tab(moe_index);
        d.tc = m.tiers->count(moe_index);
      } else {
        d.gu = m.alloc(size_t(E) * gu_bytes, p + "experts gate/up");
        d.down = m.alloc(size_t(E) * dn_bytes, p + "experts down");
        m.bytes_total += int64_t(size_t(E) * (gu_bytes + dn_bytes));
        gu_dst = static_cast<uint8_t*>(d.gu);
        dn_dst = static_cast<uint8_t*>(d.down);
        d.gu_tab = m.contiguous_table(d.gu, E, gu_bytes, p + "expert table");
        d.down_tab = m.contiguous_table(d.down, E, dn_bytes, p + "expert table");
      }
      // Disk tier: the host holds the first host_slots experts; the others
      // are read through the store when chosen (every MoE layer has the
      // first one's format: checked above).
      const int held = tiered ? m.tiers->host_slots() : E;
      if (tiered && m.tiers->disk()) {
        if (moe_index == 0) m.disk_layers.clear();
        m.disk_layers.push_back(i);
        if (moe_index == 0)
          m.tiers->set_loader([&store, &m, dt, q = d.q](int l, int e, uint8_t* gu, uint8_t* dn) {
            const int64_t layer = m.disk_layers.at(size_t(l));
            const ExpertBatch b = store.fetch(layer, {e});
            const FfnExpert& x = b.experts.at(0);
            const std::string where = "layer " + std::to_string(layer) + " ";
            if (q.bits) {
              Impl::write_quant(x, 0, q, where, gu);
              Impl::write_quant(x, 1, q, where, dn);
            } else {
              Impl::write_rows_host({x.gate, x.up}, dt, gu);
              Impl::write_rows_host({x.down}, dt, dn);
            }
          });
      }
      // A batch of experts at a time: bounded host memory for streamed ones.
      constexpr int kBatch = 16;
      std::vector<uint8_t> stage;
      for (int e0 = 0; e0 < held; e0 += kBatch) {
        const int n = std::min(kBatch, held - e0);
        std::vector<int32_t> ids(static_cast<size_t>(n));
        std::iota(ids.begin(), ids.end(), e0);
        const ExpertBatch b = store.fetch(i, ids);
        if (!host_dst) stage.resize(size_t(n) * std::max(gu_bytes, dn_bytes));
        for (int part = 0; part < 2; ++part) {
          const size_t bytes = part == 0 ? gu_bytes : dn_bytes;
          uint8_t* dst = (part == 0 ? gu_dst : dn_dst) + size_t(e0) * bytes;
          uint8_t* out = host_dst ? dst : stage.data();
          for (int k = 0; k < n; ++k) {
            const FfnExpert& x = b.experts[size_t(k)];
            uint8_t* o = out + size_t(k) * bytes;
            if (d.q.bits) Impl::write_quant(x, part, d.q, p, o);
            else if (part == 0) Impl::write_rows_host({x.gate, x.up}, dt, o);
            else Impl::write_rows_host({x.down}, dt, o);
          }
          if (!host_dst) CK(cudaMemcpy(dst, stage.data(), size_t(n) * bytes, cudaMemcpyHostToDevice));
        }
      }
      if (moe_index == 0) tier_gu = gu_bytes, tier_dn = dn_bytes;
      if (f.has_shared) {
        d.has_shared = true;
        d.s_gu = m.upload_rows({f.shared.gate, f.shared.up}, p + "shared expert", dt);
        d.s_down = m.upload_rows({f.shared.down}, p + "shared expert", dt);
      }
    } else {
      int dt = storage_dt(f.dense.gate);
      if (storage_dt(f.dense.up) != dt || storage_dt(f.dense.down) != dt) dt = DT_F32;
      d.edt = dt;
      d.has_shared = true;
      d.s_gu = m.upload_rows({f.dense.gate, f.dense.up}, p + "mlp", dt);
      d.s_down = m.upload_rows({f.dense.down}, p + "mlp", dt);
    }
    m.L.push_back(d);
  }
  if (m.tiers) m.tiers->start();
  model.expert_store().reset_stats();  // the upload's reads are not the run's
  m.init_common();
  return cm;
}

std::unique_ptr<CudaModel> CudaModel::synthetic(const ModelConfig& cfg, uint64_t seed, const CudaOptions& o) {
  std::unique_ptr<CudaModel> cm(new CudaModel);
  Impl& m = *cm->p_;
  m.c = cfg;
  m.plan = make_plan(m.c);
  m.opts = o;
  if (o.host_cache_gb >= 0 || o.host_cache_fraction >= 0)
    fail("--gpu-host-cache: a synthetic model has no files to read experts from; give it a model (-m)");
  m.init_device();
  const ModelConfig& c = m.c;
  uint64_t salt = seed;
  auto rnd = [&](int rows, int cols, const std::string& what) {
    DMat d;
    d.dt = DT_BF16;
    d.rows = rows;
    d.cols = cols;
    d.p = m.alloc(d.bytes(), what);
    fill_random_kernel<__nv_bfloat16><<<4096, 256, 0, m.stream>>>(static_cast<__nv_bfloat16*>(d.p),
                                                                   size_t(rows) * cols, ++salt,
                                                                   1.0f / std::sqrt(float(cols)));
    check(cudaGetLastError(), "fill");
    m.bytes_total += int64_t(d.bytes());
    return d;
  };
  auto cst = [&](size_t n, float v, const std::string& what) {
    float* p = m.alloc_f(n, what);
    fill_const_kernel<<<64, 256, 0, m.stream>>>(p, n, v);
    return p;
  };
  auto rndf = [&](size_t n, float scale, const std::string& what) {
    float* p = m.alloc_f(n, what);
    fill_random_kernel<float><<<64, 256, 0, m.stream>>>(p, n, ++salt, scale);
    return p;
  };
  const int H = int(c.hidden_size), V = int(c.vocab_size);
  const int nv = int(c.lin_num_v_heads), dv = int(c.lin_v_dim);
  const int C = int(c.lin_conv_dim()), K = int(c.conv_kernel);
  const int nh = int(c.num_heads), nkv = int(c.num_kv_heads), hd = int(c.head_dim);
  const int E = int(c.num_experts), I = int(c.moe_intermediate), Is = int(c.shared_intermediate);
  m.embed = rnd(V, H, "embedding");
  m.lm_head = c.tie_word_embeddings ? m.embed : rnd(V, H, "lm_head");
  m.final_norm = cst(size_t(H), 0.f, "norm");
  void *tmp_gu = nullptr, *tmp_dn = nullptr;
  for (const LayerPlan& l : m.plan.layers) {
    DLayer d;
    d.in_norm = cst(size_t(H), 0.f, "norm");
    d.post_norm = cst(size_t(H), 0.f, "norm");
    if (l.mixer == MixerKind::GatedAttention) {
      d.qkv = rnd(2 * nh * hd + 2 * nkv * hd, H, "qkv");
      d.o_proj = rnd(H, nh * hd, "o_proj");
      d.q_norm = cst(size_t(hd), 0.f, "q_norm");
      d.k_norm = cst(size_t(hd), 0.f, "k_norm");
    } else {
      d.lin_in = rnd(C + nv * dv + 2 * nv, H, "linear in");
      d.out_proj = rnd(H, nv * dv, "linear out");
      d.conv_w = rndf(size_t(C) * K, 0.5f, "conv");
      d.dt_bias = cst(size_t(nv), 0.f, "dt_bias");
      d.neg_exp_A = cst(size_t(nv), -1.f, "A");
      d.gnorm = cst(size_t(dv), 1.f, "gnorm");
    }
    if (l.ffn == FfnKind::RoutedMoE) {
      const int moe_index = l.moe_slot;
      d.router = rnd(E + (Is > 0 ? 1 : 0), H, "router");
      d.edt = DT_BF16;
      if (o.synthetic_experts != QuantKind::None) {
        const int bits = quant_bits(o.synthetic_experts), g = o.synthetic_group;
        if (g <= 0 || g % 8 != 0 || H % g != 0 || I % g != 0 || H % (128 / bits) != 0 || I % (128 / bits) != 0)
          fail("bench: --group " + std::to_string(g) + " must be a multiple of 8 dividing the hidden size " +
               std::to_string(H) + " and the expert size " + std::to_string(I));
        d.q = make_qexpert(bits, g, H, I);
      }
      const size_t gu_bytes = d.q.bits ? d.q.gu_bytes : size_t(2 * I) * H * 2;
      const size_t dn_bytes = d.q.bits ? d.q.dn_bytes : size_t(H) * I * 2;
      if (moe_index == 0 && m.make_tiers(gu_bytes, dn_bytes, m.plan.moe_layers)) {
        // Staging for one layer's experts, generated on the device and copied to pinned memory.
        tmp_gu = dev_alloc(size_t(E) * gu_bytes, "synthetic expert staging");
        tmp_dn = dev_alloc(size_t(E) * dn_bytes, "synthetic expert staging");
      }
      // E experts' gate/up and down blocks: random bf16 weights, or random
      // codes with scales and biases that spread them over the same range.
      auto fill = [&](void* gu, void* dn) {
        if (!d.q.bits) {
          fill_random_kernel<__nv_bfloat16><<<4096, 256, 0, m.stream>>>(
              static_cast<__nv_bfloat16*>(gu), size_t(E) * 2 * I * H, ++salt, 1.0f / std::sqrt(float(H)));
          fill_random_kernel<__nv_bfloat16><<<4096, 256, 0, m.stream>>>(
              static_cast<__nv_bfloat16*>(dn), size_t(E) * H * I, ++salt, 1.0f / std::sqrt(float(I)));
        } else {
          const QExpert& q = d.q;
          fill_bytes_kernel<<<4096, 256, 0, m.stream>>>(static_cast<uint32_t*>(gu), size_t(E) * q.gu_bytes / 4, ++salt);
          fill_bytes_kernel<<<4096, 256, 0, m.stream>>>(static_cast<uint32_t*>(dn), size_t(E) * q.dn_bytes / 4, ++salt);
          const float top = float((1 << q.bits) - 1);
          auto affine = [&](void* base, size_t stride, size_t s_off, size_t b_off, int rows, int cols) {
            const size_t n = size_t(rows) * (cols / q.group);
            const float r = 1.0f / std::sqrt(float(cols));
            fill_bf16_parts_kernel<<<1024, 256, 0, m.stream>>>(static_cast<uint8_t*>(base), stride, E, s_off, n, 2 * r / top);
            fill_bf16_parts_kernel<<<1024, 256, 0, m.stream>>>(static_cast<uint8_t*>(base), stride, E, b_off, n, -r);
          };
          affine(gu, q.gu_bytes, q.gate_s, q.gate_b, I, H);
          affine(gu, q.gu_bytes, q.up_s, q.up_b, I, H);
          affine(dn, q.dn_bytes, q.dn_s, q.dn_b, H, I);
        }
        check(cudaGetLastError(), "fill");
      };
      if (m.tiers) {
        fill(tmp_gu, tmp_dn);
        CK(cudaMemcpyAsync(m.tiers->host_gu(moe_index), tmp_gu, size_t(E) * gu_bytes, cudaMemcpyDeviceToHost, m.stream));
        CK(cudaMemcpyAsync(m.tiers->host_down(moe_index), tmp_dn, size_t(E) * dn_bytes, cudaMemcpyDeviceToHost, m.stream));
        d.gu_tab = m.tiers->gu_tab(moe_index);
        d.down_tab = m.tiers->down_tab(moe_index);
        d.tc = m.tiers->count(moe_index);
      } else {
        d.gu = m.alloc(size_t(E) * gu_bytes, "experts gate/up");
        d.down = m.alloc(size_t(E) * dn_bytes, "experts down");
        m.bytes_total += int64_t(size_t(E) * (gu_bytes + dn_bytes));
        fill(d.gu, d.down);
        d.gu_tab = m.contiguous_table(d.gu, E, gu_bytes, "expert table");
        d.down_tab = m.contiguous_table(d.down, E, dn_bytes, "expert table");
      }
      if (Is > 0) {
        d.has_shared = true;
        d.s_gu = rnd(2 * Is, H, "shared expert");
        d.s_down = rnd(H, Is, "shared expert");
      }
    } else {
      const int Id = int(c.intermediate_size);
      d.has_shared = true;
      d.s_gu = rnd(2 * Id, H, "mlp");
      d.s_down = rnd(H, Id, "mlp");
    }
    m.L.push_back(d);
  }
  CK(cudaStreamSynchronize(m.stream));
  cudaFree(tmp_gu);
  cudaFree(tmp_dn);
  if (m.tiers) m.tiers->start();
  m.init_common();
  return cm;
}

std::unique_ptr<CudaState> CudaModel::new_state(const KvConfig& kv) const {
  const Impl& m = *p_;
  kv.validate();
  const KvRetention ret = kv.retention();
  if (kv.capacity() > (int64_t(1) << 30))
    fail_device(DeviceFailure::Unsupported, "CUDA backend: a KV cache of " + std::to_string(kv.capacity()) +
                                                " positions per layer is more than it supports (2^30)");
  CK(cudaSetDevice(m.dev));
  auto st = std::make_unique<CudaState>();
  st->p_ = std::make_unique<CudaState::Impl>();
  CudaState::Impl& s = *st->p_;
  s.dev = m.dev;
  s.kv = kv;
  s.nkv = int(m.c.num_kv_heads);
  s.hd = int(m.c.head_dim);
  s.nh = int(m.c.num_heads);
  switch (kv.dtype) {
    case KvDType::F32: s.kvt = KV_F32; s.el = 4; break;
    case KvDType::BF16: s.kvt = KV_BF16; s.el = 2; break;
    case KvDType::F16: s.kvt = KV_F16; s.el = 2; break;
    case KvDType::FP8: s.kvt = KV_FP8; s.el = 1; break;
  }
  s.ns = kv.dtype != KvDType::FP8 ? 0 : kv.fp8_scale == Fp8ScaleMode::Head ? s.nkv : 1;
  if (s.ns > 64) fail_device(DeviceFailure::Unsupported, "CUDA backend: more than 64 KV heads with per-head fp8 scales is not supported");
  if (ret == KvRetention::Window) s.window = int(kv.window);
  if (ret == KvRetention::Streaming) {
    s.window = int(kv.window);
    s.sinks = int(kv.sinks);
  }
  s.h2o = ret == KvRetention::H2O;
  if (s.h2o) s.sinks = int(kv.sinks);
  s.cap = s.window > 0 ? s.window : s.h2o ? int(kv.h2o_budget) : 1024;
  const size_t row = size_t(s.nkv) * s.hd;
  const int64_t C = m.c.lin_conv_dim(), Kc = m.c.conv_kernel;
  const int64_t ssm_n = m.c.lin_num_v_heads * m.c.lin_k_dim * m.c.lin_v_dim;
  for (const LayerPlan& lp : m.plan.layers) {  // in order: state_slot is the index in kvl / conv / ssm
    if (lp.mixer == MixerKind::GatedAttention) {
      KvLayer l{};
      l.cap = s.cap;
      l.window = s.window;
      l.sinks = s.sinks;
      // pushed first so that the destructor frees whatever was allocated
      s.kvl.push_back(l);
      KvLayer& b = s.kvl.back();
      b.k = dev_alloc(size_t(s.cap) * row * s.el, "KV cache");
      b.v = dev_alloc(size_t(s.cap) * row * s.el, "KV cache");
      b.ks = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.ns, 1) * 4, "KV scales"));
      b.vs = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.ns, 1) * 4, "KV scales"));
      if (s.h2o) {
        b.recent = int(kv.h2o_recent());
        b.acc = static_cast<float*>(dev_alloc(size_t(s.cap) * 4, "h2o scores"));
        b.kpos = static_cast<int*>(dev_alloc(size_t(s.cap) * 4, "h2o positions"));
        CK(cudaMemset(b.acc, 0, size_t(s.cap) * 4));
        CK(cudaMemset(b.kpos, 0xff, size_t(s.cap) * 4));  // -1: free
      }
    } else {
      // [C][K-1] in use (the K-1 previous inputs per channel); C * K floats
      // allocated, the size of the buffer in state images (save_state).
      s.conv.push_back(static_cast<float*>(dev_alloc(size_t(C * Kc) * 4, "conv state")));
      CK(cudaMemset(s.conv.back(), 0, size_t(C * Kc) * 4));
      s.ssm.push_back(static_cast<float*>(dev_alloc(size_t(ssm_n) * 4, "delta-rule state")));
      CK(cudaMemset(s.ssm.back(), 0, size_t(ssm_n) * 4));
    }
  }
  s.scores = static_cast<float*>(dev_alloc(size_t(s.cap) * std::max(s.nh, 1) * 4, "attention scores"));
  s.d_pos = static_cast<int*>(dev_alloc(4, "counters"));
  s.d_base = static_cast<int*>(dev_alloc(4, "counters"));
  s.d_step = static_cast<int*>(dev_alloc(4, "counters"));
  s.d_ids = static_cast<int*>(dev_alloc(size_t(kRing) * 4, "token ids"));
  s.d_out = static_cast<int*>(dev_alloc(size_t(kRing) * 4, "token ids"));
  for (int* p : {s.d_pos, s.d_base, s.d_step}) CK(cudaMemset(p, 0, 4));
  CK(cudaMemset(s.d_ids, 0, size_t(kRing) * 4));
  CK(cudaDeviceSynchronize());
  return st;
}

namespace {
// Bytes of each buffer of a state image, in save_state's order: per KV layer
// K, V (rows in use), the fp8 K, V scales and h2o's scores and positions;
// then each conv and delta-rule state.
std::vector<size_t> image_sizes(const ModelConfig& c, const CudaState::Impl& s, int64_t pos) {
  const size_t used = size_t(std::min<int64_t>(pos, s.cap)), row = size_t(s.nkv) * s.hd * s.el;
  const size_t srow = s.ns ? size_t(s.ns) * 4 : 0, hrow = s.h2o ? 4 : 0;
  std::vector<size_t> z;
  for (size_t i = 0; i < s.kvl.size(); ++i)
    z.insert(z.end(), {used * row, used * row, used * srow, used * srow, used * hrow, used * hrow});
  const size_t conv = size_t(c.lin_conv_dim() * c.conv_kernel) * 4;
  const size_t ssm = size_t(c.lin_num_v_heads * c.lin_k_dim * c.lin_v_dim) * 4;
  for (size_t i = 0; i < s.conv.size(); ++i) z.push_back(conv);
  for (size_t i = 0; i < s.ssm.size(); ++i) z.push_back(ssm);
  return z;
}
// The device buffers of a state, in the same order.
std::vector<void*> image_buffers(const CudaState::Impl& s) {
  std::vector<void*> b;
  for (const KvLayer& l : s.kvl) b.insert(b.end(), {l.k, l.v, l.ks, l.vs, l.acc, l.kpos});
  for (float* p : s.conv) b.push_back(p);
  for (float* p : s.ssm) b.push_back(p);
  return b;
}
}  // namespace

CudaStateImage CudaModel::save_state(const CudaState& st) const {
  const Impl& m = *p_;
  const CudaState::Impl& s = *st.p_;
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  CudaStateImage img;
  img.kv = s.kv;
  img.pos = s.pos;
  const std::vector<size_t> z = image_sizes(m.c, s, s.pos);
  const std::vector<void*> b = image_buffers(s);
  for (size_t i = 0; i < z.size(); ++i) {
    img.buffers.emplace_back(z[i]);
    if (z[i]) CK(cudaMemcpy(img.buffers.back().data(), b[i], z[i], cudaMemcpyDeviceToHost));
  }
  return img;
}

std::unique_ptr<CudaState> CudaModel::load_state(const CudaStateImage& img) const {
  Impl& m = *p_;
  auto st = new_state(img.kv);
  CudaState::Impl& s = *st->p_;
  if (img.pos < 0 || img.pos >= (int64_t(1) << 30)) fail("conversation snapshot: bad position");
  m.ensure_cap(s, img.pos);
  const std::vector<size_t> z = image_sizes(m.c, s, img.pos);
  const std::vector<void*> b = image_buffers(s);
  if (img.buffers.size() != z.size()) fail("conversation snapshot: taken from another model");
  for (size_t i = 0; i < z.size(); ++i) {
    if (img.buffers[i].size() != z[i]) fail("conversation snapshot: taken from another model or KV configuration");
    if (z[i]) CK(cudaMemcpy(b[i], img.buffers[i].data(), z[i], cudaMemcpyHostToDevice));
  }
  s.pos = img.pos;
  const int p32 = int(img.pos);
  CK(cudaMemcpy(s.d_pos, &p32, 4, cudaMemcpyHostToDevice));
  return st;
}

std::vector<int64_t> CudaModel::kv_positions(const CudaState& st, int layer) const {
  const Impl& m = *p_;
  const CudaState::Impl& s = *st.p_;
  if (layer < 0 || size_t(layer) >= s.kvl.size()) fail("kv_positions: no full-attention layer " + std::to_string(layer));
  std::vector<int64_t> out;
  if (s.h2o) {
    std::vector<int> kp(size_t(s.cap));
    CK(cudaSetDevice(m.dev));
    CK(cudaStreamSynchronize(m.stream));
    CK(cudaMemcpy(kp.data(), s.kvl[size_t(layer)].kpos, kp.size() * 4, cudaMemcpyDeviceToHost));
    for (int p : kp)
      if (p >= 0) out.push_back(p);
    std::sort(out.begin(), out.end());
    return out;
  }
  // The other policies place positions by formula (kv_slot).
  const int64_t W = s.window, S = s.sinks;
  for (int64_t p = 0; p < s.pos; ++p)
    if (W == 0 || p >= s.pos - (W - S) || p < S) out.push_back(p);
  return out;
}

void CudaModel::forward(CudaState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  const int64_t V = m.c.vocab_size;
  check_token_ids(m.c, ids, n);
  CK(cudaSetDevice(m.dev));
  m.ensure_cap(s, s.pos + n);
  Prefill* pf = n > 1 ? m.batched() : nullptr;
  for (int64_t b = 0; b < n; b += kRing - 1) {
    const int64_t len = std::min<int64_t>(kRing - 1, n - b);
    m.put_ids(s, ids + b, len);
    if (pf) {
      PrefillState ps;
      ps.kvl = &s.kvl;
      ps.conv = &s.conv;
      ps.ssm = &s.ssm;
      ps.kvt = s.kvt;
      ps.ns = s.ns;
      ps.el = s.el;
      ps.d_pos = s.d_pos;
      ps.scores = s.scores;
      ps.attn_split = m.attn_blocks(s.cap, s.hd);
      for (int64_t c0 = 0; c0 < len; c0 += pf->max_tokens()) {
        const int T = int(std::min<int64_t>(pf->max_tokens(), len - c0));
        pf->run(ps, s.d_ids + c0, T, s.pos);
        s.pos += T;
        if (m.tiers) m.tiers->maintain(m.stream, T);
        const int64_t g0 = b + c0;
        if (mode == LogitsMode::All) {
          pf->logits(0, T, logits + g0 * V);
        } else if (mode == LogitsMode::Last && g0 + T == n) {
          CK(cudaMemcpyAsync(m.x, pf->hidden(T - 1), size_t(m.c.hidden_size) * 4, cudaMemcpyDeviceToDevice, m.stream));
          m.pdl_next = false;
          m.matvec(m.lm_head, m.x, m.final_norm, m.logits, 0, K_LMHEAD);
          CK(cudaMemcpyAsync(m.pinned_logits, m.logits, size_t(V) * 4, cudaMemcpyDeviceToHost, m.stream));
          CK(cudaStreamSynchronize(m.stream));
          std::memcpy(logits, m.pinned_logits, size_t(V) * 4);
        }
      }
      CK(cudaStreamSynchronize(m.stream));
      continue;
    }
    for (int64_t t = 0; t < len; ++t) {
      const int64_t g = b + t;
      const bool want = mode == LogitsMode::All || (mode == LogitsMode::Last && g == n - 1);
      m.run_step(s, want ? 1 : 0);
      ++s.pos;
      if (m.tiers) m.tiers->maintain(m.stream);
      if (want) {
        CK(cudaMemcpyAsync(m.pinned_logits, m.logits, size_t(V) * 4, cudaMemcpyDeviceToHost, m.stream));
        CK(cudaStreamSynchronize(m.stream));
        std::memcpy(mode == LogitsMode::All ? logits + g * V : logits, m.pinned_logits, size_t(V) * 4);
      }
    }
    CK(cudaStreamSynchronize(m.stream));
  }
}

void CudaModel::decode_greedy(CudaState& st, int32_t first, int64_t n, int32_t* out) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  check_token_ids(m.c, &first, 1);
  CK(cudaSetDevice(m.dev));
  m.ensure_cap(s, s.pos + n);
  int32_t next = first;
  for (int64_t b = 0; b < n; b += kRing - 2) {
    const int64_t len = std::min<int64_t>(kRing - 2, n - b);
    m.put_ids(s, &next, 1);
    CK(cudaMemsetAsync(s.d_step, 0, 4, m.stream));
    for (int64_t t = 0; t < len; ++t) {
      m.run_step(s, 2);
      ++s.pos;
      if (m.tiers) m.tiers->maintain(m.stream);
    }
    CK(cudaMemcpyAsync(m.pinned_ids, s.d_out, size_t(len) * 4, cudaMemcpyDeviceToHost, m.stream));
    CK(cudaStreamSynchronize(m.stream));
    std::memcpy(out + b, m.pinned_ids, size_t(len) * 4);
    next = out[b + len - 1];
  }
}

namespace {
// The fastest of `reps` runs of copy(r) on stream s, in milliseconds.
template <class F>
float best_ms(cudaStream_t s, int reps, F copy) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, s));
    copy(r);
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}
}  // namespace

double CudaModel::copy_bandwidth_gbps() const {
  Impl& m = *p_;
  CK(cudaSetDevice(m.dev));
  size_t fr = 0, tot = 0;
  CK(cudaMemGetInfo(&fr, &tot));
  size_t bytes = std::min<size_t>(size_t(2) << 30, fr / 4);
  bytes &= ~size_t(0xfffff);
  void* a = dev_alloc(bytes, "bandwidth test");
  void* b = nullptr;
  try {
    b = dev_alloc(bytes, "bandwidth test");
  } catch (...) {
    cudaFree(a);
    throw;
  }
  CK(cudaMemsetAsync(a, 1, bytes, m.stream));
  CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, m.stream));
  const float best = best_ms(m.stream, 10, [&](int r) {
    CK(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, m.stream));
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (double(best) * 1e-3) / 1e9;
}

double CudaModel::host_link_gbps() const {
  Impl& m = *p_;
  CK(cudaSetDevice(m.dev));
  const size_t bytes = size_t(1) << 30;
  void* h = nullptr;
  CK(cudaMallocHost(&h, bytes));
  void* d = nullptr;
  try {
    d = dev_alloc(bytes, "link bandwidth test");
  } catch (...) {
    cudaFreeHost(h);
    throw;
  }
  std::memset(h, 1, bytes);
  const float best =
      best_ms(m.stream, 5, [&](int) { CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, m.stream)); });
  cudaFree(d);
  cudaFreeHost(h);
  return double(bytes) / (double(best) * 1e-3) / 1e9;
}

CudaTierStats CudaModel::tier_stats() const {
  Impl& m = *p_;
  if (!m.tiers) return {};
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  return m.tiers->stats();
}

void CudaModel::reset_tier_stats() {
  Impl& m = *p_;
  if (!m.tiers) return;
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  m.tiers->reset_stats();
}

std::vector<CudaKernelTime> CudaModel::profile_decode(CudaState& st, int32_t first, int steps) const {
  Impl& m = *p_;
  CudaState::Impl& s = *st.p_;
  CK(cudaSetDevice(m.dev));
  m.ensure_cap(s, s.pos + steps);
  std::vector<CudaKernelTime> out(K_N);
  for (int i = 0; i < K_N; ++i) out[size_t(i)].name = kClassNames[i];
  m.put_ids(s, &first, 1);
  CK(cudaMemsetAsync(s.d_step, 0, 4, m.stream));
  cudaEvent_t start;
  CK(cudaEventCreate(&start));
  m.profiling = true;
  try {
    for (int t = 0; t < steps; ++t) {
      m.event_class.clear();
      CK(cudaEventRecord(start, m.stream));
      m.enqueue_step(s, 2);
      ++s.pos;
      CK(cudaStreamSynchronize(m.stream));
      cudaEvent_t prev = start;
      for (size_t i = 0; i < m.event_class.size(); ++i) {
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, prev, m.events[i]));
        out[size_t(m.event_class[i])].ms += ms;
        out[size_t(m.event_class[i])].launches += 1;
        prev = m.events[i];
      }
    }
  } catch (...) {
    m.profiling = false;
    cudaEventDestroy(start);
    throw;
  }
  m.profiling = false;
  cudaEventDestroy(start);
  return out;
}

}  // namespace flashmoe
