// The CUDA backend's model and conversation state (the Impl structs of
// cuda_model.h), shared by the units that implement them:
//   upload.cu        weights to the device, scratch buffers, the folded routers
//   decode_step.cu   one token through every layer (the kernels' launches)
//   graph.cu         the decode step captured in a CUDA graph and replayed
//   forward.cu       forward / decode_greedy: prompts to the batched prefill or the step
//   forward_batch.cu forward_batch: several sequences' tokens in one batched step (batch_step.cu)
//   state.cu         per-conversation state: new_state, save/load, kv_positions, KV growth
//   cuda_bench.cu    benchmark-only entry points (synthetic weights, bandwidths, profile)
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/delta.cuh"
#include "backend/cuda/device_model.cuh"
#include "backend/cuda/expert_tiers.cuh"
#include "backend/cuda/experts.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/prefill.cuh"
#include "core/matrix.h"
#include "model/plan.h"

namespace flashmoe {

namespace cuda {
constexpr int kRing = 8192;  // token-id ring on the device (prompt chunks, generated ids)

// The decode step's kernels by class, for the per-class profile (cuda_bench.cu).
enum KernelClass { K_EMBED, K_PROJ, K_CONV, K_DELTA, K_ATTN, K_OUT, K_ROUTER, K_EXPERTS, K_LMHEAD, K_ARGMAX, K_N };
inline const char* const kClassNames[K_N] = {"embed",      "in-proj (norm fused)", "conv1d",  "delta-rule", "attention",
                                             "out-proj",   "router+topk",          "experts", "lm_head",    "argmax"};
}  // namespace cuda

using namespace flashmoe::cuda;

struct CudaState::Impl {
  int dev = 0;
  KvConfig kv;
  int64_t pos = 0;
  int cap = 0, window = 0, sinks = 0, kvt = KV_F32, ns = 0;
  bool h2o = false;  // h2o or tova retention: cap slots, KvLayer acc / kpos (scores) and victims
  size_t el = 4;
  int nkv = 0, hd = 0, nh = 0;
  std::vector<KvLayer> kvl;
  std::vector<float*> conv, ssm;
  float* scores = nullptr;
  int *d_pos = nullptr, *d_base = nullptr, *d_ids = nullptr, *d_out = nullptr, *d_step = nullptr;
  cudaGraphExec_t graphs[3] = {nullptr, nullptr, nullptr};  // per kind of step (graph.cu)

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

struct CudaModel::Impl : Launcher {
  ModelConfig c;
  int dev = 0;
  std::vector<void*> allocs;
  DMat embed, lm_head;
  float* final_norm = nullptr;
  std::vector<DLayer> L;  // indexed by LayerPlan::index
  ModelPlan plan;  // the layers in order (make_plan), walked by the decode step and the prefill
  float* inv_freq = nullptr;  // plan.rope_inv_freq on the device
  float* ones = nullptr;
  float *x = nullptr, *proj = nullptr, *convout = nullptr, *lin_o = nullptr, *q = nullptr, *attn_o = nullptr,
        *rlogits = nullptr, *ew = nullptr, *hb = nullptr, *logits = nullptr;
  int* eids = nullptr;
  int maxI = 0;
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
  // Disk tier (experts read from the packed files when chosen).
  bool disk = false;
  std::vector<int64_t> disk_layers;  // model layer of each MoE layer (the loader's store requests)
  // Expert parallelism over several GPUs (multi_gpu.cu): this GPU's rank,
  // its communicator and buffers; null on one GPU. Around each routed MoE's
  // expert kernels: ep_before_ffn keeps the residual (ranks > 0),
  // ep_after_ffn all-reduces the experts' sum into x.
  struct ExpertParallel* ep = nullptr;
  void ep_before_ffn();
  void ep_after_ffn();
  // The same around the batched prefill's experts over T rows at `rows`.
  void ep_before_rows(float* rows, int T);
  void ep_after_rows(float* rows, int T);
  // Profiling (cuda_profile_decode): an event after each launch, with its kernel class.
  bool profiling = false;
  std::vector<cudaEvent_t> events;
  std::vector<int> event_class;

  ~Impl();

  // upload.cu
  void* alloc(size_t bytes, const std::string& what);
  float* alloc_f(size_t n, const std::string& what) { return static_cast<float*>(alloc(n * 4, what)); }
  float* upload_vec(const std::vector<float>& v, const std::string& what);
  // Rows of several host matrices (same cols) written one after the other
  // into dst (host memory) in storage type dt; returns the bytes written.
  static size_t write_rows_host(const std::vector<Matrix>& parts, int dt, uint8_t* dst);
  // Rows of several host matrices (same cols) stacked into one device matrix,
  // in the common storage type (f32 when they differ or when forced).
  // fp8: parts that are all FP8 blocks of one block width stay FP8 (DT_FP8).
  DMat upload_rows(const std::vector<Matrix>& parts, const std::string& what, int force_dt = -1, bool fp8 = false);
  DMat upload_fp8_rows(const std::vector<Matrix>& parts, const std::string& what);
  // The device layout of a layer's quantised experts (all like `e`), or an
  // Error naming the layer where the kernels cannot take them.
  QExpert quant_layout(const FfnExpert& e, const std::string& where) const;
  // Expert e's gate/up block (part 0) or down block (1) in the layout q, at dst.
  static void write_quant(const FfnExpert& e, int part, const QExpert& q, const std::string& where, uint8_t* dst);
  // GGUF matrices: parts (each in a block format) stacked as stored (GMat).
  DMat upload_blocks(const std::vector<Matrix>& parts, const std::string& what);
  // The device layout of a layer's GGUF experts (all like `e`): gg, gd and
  // the bytes of an expert's gate/up and down blocks.
  void gguf_expert_layout(const FfnExpert& e, DLayer& d, size_t& gu_bytes, size_t& dn_bytes) const;
  // Expert e's gate/up block (part 0) or down block (1) in layer d's GGUF layout, at dst.
  static void write_gguf_expert(const FfnExpert& e, int part, const GMat& gg, const GMat& gd, const std::string& where,
                                uint8_t* dst);
  // Expert pointer table of a layer whose experts are contiguous in VRAM.
  const void* const* contiguous_table(const void* base, int E, size_t stride, const std::string& what);
  // Slots per MoE layer for the routed experts in a budget of gb (or a
  // fraction of all expert bytes); E (all) when neither is given.
  int expert_slots(int64_t expert_bytes, int64_t moe, double gb, double fraction) const;
  // Creates the tiered cache when the routed experts (gu + dn bytes each) do
  // not all get VRAM.
  bool make_tiers(size_t gu, size_t dn, int moe);
  void init_device();
  // Scratch buffers and constants, once the dimensions are known.
  void init_common();
  // Folds each MoE layer's router into its output projection's launch where
  // the shapes allow (see outproj_router_kernel); other layers keep the router.
  template <typename T>
  void fold_router(DLayer& d, const DMat& out);
  void fold_routers();

  // decode_step.cu
  // The attributes of the kernels that need more than 48 KB of shared memory.
  void set_kernel_attributes();
  void mark(int cls);
  void matvec(const DMat& W, const float* xin, const float* nw, float* y, int acc, int cls, float* xcopy = nullptr);
  void matvec_fp8(const DMat& W, const float* xin, const float* nw, float* y, int acc, int cls, float* xcopy);
  // x += W_out . o and the folded router's logits, one launch (outproj_router_kernel).
  void outproj_router(const DLayer& d, const DMat& W);
  // Router logits, then the top-k kernel unless gate_up picks (pick_in_kernels:
  // bf16 and FP8 experts, GGUF ones on the staged kernels).
  void route(const DLayer& d);
  // Whether the layer's GGUF feed-forward runs on gguf_staged.cuh's kernels
  // (routed: with its routed experts); S1, S2 their buffer bytes per warp.
  bool gguf_staged(const DLayer& d, bool routed, int& S1, int& S2) const;
  // Blocks per query head in attn_kernel (a cluster, each a slice of the
  // positions): one per 256 positions of KV capacity, 1 to 8, so a long
  // context is read by up to 8x as many SMs (one per 1024 left a 2048
  // window on 2 blocks per head: h2b in bench/NOTES-cuda.md). The graph is
  // captured per capacity (ensure_cap drops it), so this follows the cache.
  int attn_blocks(int cap, int hd) const;
  // The delta step on delta_cluster_kernel (a cluster of blocks per head) where
  // its shapes allow; false: the caller launches delta_kernel.
  bool delta_cluster(const DeltaArgs& a);
  template <typename T>
  void moe_launch(const MoeArgs& a, int slots);
  // The experts of a layer of quantised experts (shared expert in storage type sdt).
  template <int BITS>
  void moe_launch_q(const MoeArgs& a, int slots, const QExpert& q, int sdt);
  void moe_launch_q(const MoeArgs& a, int slots, const QExpert& q, int sdt);
  // A GatedDeltaNet layer's mixer (state slot sl): in-proj (input norm
  // fused), conv1d, the delta-rule step, out-proj (+ the folded router).
  void delta_net(CudaState::Impl& s, const DLayer& d, int sl);
  // A gated attention layer's mixer (KV cache sl): q/k/v projection (input
  // norm fused), rope + KV store, attention, h2o's scores, o_proj (+ the
  // folded router).
  void attention(CudaState::Impl& s, const DLayer& d, int sl);
  // The feed-forward's arguments common to routed and dense layers.
  MoeArgs ffn_args(const DLayer& d) const;
  // The expert kernels of a feed-forward of `slots` slots, by storage type.
  void ffn_launch(const DLayer& d, const MoeArgs& a, int slots);
  // A routed MoE (MoE layer mi): routing (unless folded into the output
  // projection), the disk tier's reads, the top-k experts + shared expert.
  void routed_moe(const DLayer& d, int mi);
  // A dense SwiGLU MLP: the expert kernels with one slot (weight 1).
  void dense_mlp(const DLayer& d);
  // One token through the model. kind 0: no logits; 1: logits; 2: logits + argmax.
  void enqueue_step(CudaState::Impl& s, int kind);
  // Disk tier, after the routing of MoE layer mi: the chosen experts
  // resident (read from disk where needed) before its expert kernels.
  void disk_fetch(int mi);
  // The n expert ids at d_ids (device) of MoE layer mi resident, tables set on the stream.
  void fetch_experts(int mi, const int* d_ids, int n);

  // graph.cu, state.cu, forward.cu
  void run_step(CudaState::Impl& s, int kind);
  // Full retention: grow the KV storage (and scores) to hold `slots`.
  void ensure_cap(CudaState::Impl& s, int64_t slots);
  // The batched prefill, made at its first use; null where it cannot run
  // (switched off, shapes it does not cover, no device memory left for its
  // buffers): token by token then.
  Prefill* batched();
  // Puts ids[0..n) into the device ring at positions pos.. (base = pos).
  void put_ids(CudaState::Impl& s, const int32_t* ids, int64_t n);
  // What the batched prefill reads and writes of state s (its KV layers,
  // conv and delta states, retention scores, position).
  PrefillState prefill_state(CudaState::Impl& s) const;
};

// The Impl of a CudaModel, and a new empty CudaModel: for the units of this
// backend outside the class (cuda_bench.cu).
struct CudaModelAccess {
  static CudaModel::Impl& impl(const CudaModel& m) { return *m.p_; }
  static std::unique_ptr<CudaModel> make() { return std::unique_ptr<CudaModel>(new CudaModel); }
};

}  // namespace flashmoe
