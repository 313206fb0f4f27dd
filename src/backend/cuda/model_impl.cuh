// The CUDA backend's model and conversation state (the Impl structs of
// cuda_model.h), shared by the units that implement them:
//   upload.cu        weights to the device, scratch buffers, the folded routers
//   decode_step.cu   one token through every layer (the kernels' launches)
//   graph.cu         the decode step captured in a CUDA graph and replayed
//   forward.cu       forward / decode_greedy: prompts to the batched prefill or the step
//   forward_batch.cu forward_batch: several sequences' tokens in one batched step (batch_step.cu)
//   state.cu         per-conversation state: new_state, save/load, kv_positions, KV growth
//   mtp.cu           the MTP head: its upload, keeping its KV cache in step, drafting
//   verify.cu        speculative decoding's verify pass (step_batch over one sequence's rows), take_back
//   cuda_bench.cu    benchmark-only entry points (synthetic weights, bandwidths, profile)
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/delta.cuh"
#include "backend/cuda/device_model.cuh"
#include "backend/cuda/expert_tiers.cuh"
#include "backend/cuda/experts.cuh"
#include "backend/cuda/host_prefetch.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/prefill.cuh"
#include "backend/cuda/quest.cuh"
#include "core/matrix.h"
#include "model/plan.h"

namespace flashmoe {

namespace cuda {
constexpr int kRing = 8192;  // token-id ring on the device (prompt chunks, generated ids)
// The most tokens a verify pass (verify.cu) takes: --spec-draft 7 and the
// token before the drafts; longer ones go through the batched prefill.
constexpr int kVerifyRows = 8;
// Greedy drafts picked on the device per draft() call (more: on the host).
constexpr int kDeviceDrafts = 64;

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
  int cap_new = 0;  // cap when made: a state reused (release_state) only before its KV grew
  bool h2o = false;  // h2o or tova retention: cap slots, KvLayer acc / kpos (scores) and victims
  // snapkv (snapkv.cu): full retention and each layer's ring of the last
  // kSnapObserved prompt queries (snap_q) until the first single-token
  // step; then B slots, the kept prompt positions in [0, B - R) (snap_fixed,
  // per layer) and a ring of R, positions counted from snap_shift.
  bool snap = false, snap_done = false;
  std::vector<float*> snap_q;
  std::vector<std::vector<int64_t>> snap_fixed;
  int64_t snap_shift = 0;
  size_t el = 4;
  int nkv = 0, hd = 0, nh = 0;
  std::vector<KvLayer> kvl;
  std::vector<float*> conv, ssm;  // pieces of `recurrent`
  float* scores = nullptr;
  int *d_pos = nullptr, *d_base = nullptr, *d_ids = nullptr, *d_out = nullptr, *d_step = nullptr;  // of `counters`
  // One allocation each (new_state): every linear layer's conv and
  // delta-rule states, and the counters and token rings. A state per
  // request in the server: ~100 cudaMalloc calls each were ~3 ms.
  void *recurrent = nullptr, *counters = nullptr;
  size_t recurrent_bytes = 0, counters_bytes = 0;
  // Recorded on the model's stream when the state was released for reuse
  // (CudaModel::release_state): copies still queued there (a VRAM snapshot
  // of it) come before a new owner's zeroing.
  cudaEvent_t released = nullptr;
  cudaGraphExec_t graphs[3] = {nullptr, nullptr, nullptr};  // per kind of step (graph.cu)
  // A drafting state (--mtp): the MTP head's own state (one KV layer, its
  // position counter; attention() runs on it as on a main layer's), and
  // the final-normed hidden state of the last consumed token (valid once
  // pos > 0). The head's cache holds entries 0 .. pos-2 (entry j: the
  // hidden state at j and token j+1).
  std::unique_ptr<CudaState::Impl> head;
  float* head_hidden = nullptr;  // [H]
  KvLayer head_scratch{};        // windowed caches: drafts run on a copy of the head's layer
  // The device-side restore point (CudaModel::mark_rollback): copies of the
  // buffers that tokens fed after it overwrite, and its position (-1: none).
  std::vector<void*> bak;
  int64_t bak_pos = -1;
  // A drafting state's verify pass (verify.cu): per linear layer the conv
  // and delta-rule states after each of its first kVerifyRows - 1 rows, the
  // head's hidden state after each row, take_back's copies to return to
  // each row (device, RowCopy), and the last pass's first position and rows
  // (verify_n 0: nothing to take back; any other forward pass clears it).
  std::vector<float*> conv_rows, ssm_rows;
  float* head_rows = nullptr;
  float* verify_scores = nullptr;  // the rows' attention scratch: kVerifyRows x [nh][cap]
  int verify_scores_cap = 0;
  void* verify_jobs = nullptr;
  int64_t verify_p0 = 0;
  int verify_n = 0;

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
      for (void* p : kv_layer_buffers(l)) cudaFree(p);
    cudaFree(recurrent);
    for (float* p : snap_q) cudaFree(p);
    for (void* p : {head_scratch.k, head_scratch.v, static_cast<void*>(head_scratch.ks),
                    static_cast<void*>(head_scratch.vs), static_cast<void*>(head_hidden)})
      cudaFree(p);
    for (void* p : bak) cudaFree(p);
    for (float* p : conv_rows) cudaFree(p);
    for (float* p : ssm_rows) cudaFree(p);
    cudaFree(head_rows);
    if (released) cudaEventDestroy(released);
    cudaFree(verify_scores);
    cudaFree(verify_jobs);
    cudaFree(scores);
    cudaFree(counters);
  }
};

// The MTP head on the device (mtp.cu): fc over [norm_e(embed(token)) |
// norm_h(hidden)], one decoder layer (gated attention, then its FFN) run by
// the decode step's own functions, the head's final norm; the shared lm_head.
struct DeviceMtp {
  DMat fc;  // [H, 2H]
  float *norm_embedding = nullptr, *norm_hidden = nullptr, *final_norm = nullptr;
  DLayer layer;
  FfnKind ffn = FfnKind::RoutedMoE;
  float *in = nullptr, *out = nullptr, *hn = nullptr;  // [2H], [H], [H] scratch
  int* tok = nullptr;  // the drafted token fed to the next draft step (device)
  int* drafted = nullptr;  // [kDeviceDrafts]: greedy drafting's ids (device)
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
  // GGUF routed experts in the chunk layout (gguf_chunks.cuh), decided at
  // the first MoE layer (upload.cu); false: as the file stores them.
  bool gguf_chunks = false;
  // Host-tier experts by the copy engine (host_prefetch.cuh): on or off
  // (the zero-copy kernels, the graph), copies ahead per MoE layer, the
  // staging area, the picks' sources on the device and in pinned memory, the
  // copy stream and its events, and the counts (copies ahead made; used:
  // chosen experts read from a copy ahead).
  bool host_copies = false;
  int prefetch_n = 0;
  uint8_t* pf_stage = nullptr;
  size_t pf_gu = 0, pf_dn = 0;
  const void** pf_src = nullptr;
  float* pf_logits = nullptr;
  unsigned* pf_done = nullptr;
  unsigned long long* pf_used = nullptr;
  PrefetchPick* pf_pick = nullptr;      // host address
  PrefetchPick* pf_pick_dev = nullptr;  // its device address
  cudaStream_t pf_stream = nullptr;
  // new_state zeroes a state's buffers on this stream, not on the model's
  // (where it would wait behind a step in flight) nor the legacy default
  // stream (cudaMemset).
  cudaStream_t state_stream = nullptr;
  cudaEvent_t pf_picked = nullptr, pf_copied = nullptr;
  uint64_t pf_copies = 0;
  // The flags the copy stream writes ([kStageSlots], device), the ring of
  // values for the 4-byte copies that write them without
  // cuStreamWriteValue32 (pinned), the layer's sequence number, each routed
  // slot's staging slot ([k], device), and whether the first MoE layer's
  // pick must wait for copies still in flight.
  unsigned* pf_flag = nullptr;
  unsigned* pf_seq_host = nullptr;
  unsigned pf_seq = 0;
  int* pf_slot = nullptr;
  bool pf_outstanding = false;
  // The chosen host-tier experts not copied ahead, copied after the router
  // (stage_sel_kernel lists them in pf_rest, pinned + mapped; pf_staged
  // marks the list written), counted in pf_rest_copies; cuStreamWriteValue32
  // where the driver gives it (null: the flags by 4-byte copies).
  PrefetchRest* pf_rest = nullptr;      // host address
  PrefetchRest* pf_rest_dev = nullptr;  // its device address
  cudaEvent_t pf_staged = nullptr;
  uint64_t pf_rest_copies = 0;
  void* write_value32 = nullptr;
  // The copies ahead of a MoE layer after the step's first predicted at the
  // previous MoE layer's router (its router applied to that layer's
  // residual before its experts) and issued right after that layer's own
  // copies, into the staging slots of the other parity (MoE index % 2:
  // slots 0.. or kPrefetchMax / 2..); pf_next_n: how many were issued for
  // the coming layer.
  bool prefetch_next = false;
  int pf_next_n = 0;
  bool pf_has_next = false;  // the current layer's prefetch_copy enqueued the next one's pick
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
  // States released for reuse (release_state), most recent last.
  mutable std::vector<std::unique_ptr<CudaState::Impl>> free_states;
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
  // dense: a matrix of the decode step's matvec (projections, lm_head), GGUF blocks repacked (gguf_dense_layout.cuh).
  DMat upload_rows(const std::vector<Matrix>& parts, const std::string& what, int force_dt = -1, bool fp8 = false,
                   bool dense = false);
  DMat upload_fp8_rows(const std::vector<Matrix>& parts, const std::string& what);
  // The device layout of a layer's quantised experts (all like `e`), or an
  // Error naming the layer where the kernels cannot take them.
  QExpert quant_layout(const FfnExpert& e, const std::string& where) const;
  // Expert e's gate/up block (part 0) or down block (1) in the layout q, at dst.
  static void write_quant(const FfnExpert& e, int part, const QExpert& q, const std::string& where, uint8_t* dst);
  // GGUF matrices: parts (each in a block format) stacked as stored (GMat).
  DMat upload_blocks(const std::vector<Matrix>& parts, const std::string& what, bool dense);
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
  // Whether the layer's routed GGUF experts are in the chunk layout and run
  // on gguf_chunk_experts.cuh's kernels.
  bool gguf_chunked(const DLayer& d) const;
  // Whether a GGUF MoE layer's gate_up picks the experts (chunked or staged).
  bool gguf_picks(const DLayer& d) const;
  // Blocks per query head in attn_kernel (a cluster, each a slice of the
  // positions): one per 256 positions of KV capacity, 1 to 8, so a long
  // context is read by up to 8x as many SMs (one per 1024 left a 2048
  // window on 2 blocks per head: h2b in bench/NOTES-cuda.md). The graph is
  // captured per capacity (ensure_cap drops it), so this follows the cache.
  int attn_blocks(int cap, int hd) const;
  // The positions a query of s reads at most, which attn_blocks sizes for:
  // the capacity, or the resident budget of a Quest store.
  static int attn_positions(const CudaState::Impl& s) {
    return s.kv.resident > 0 ? int(std::min<int64_t>(s.cap, s.kv.resident)) : s.cap;
  }
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
  // Host-tier experts by the copy engine (host_prefetch.cuh): whether layer
  // d's experts can be; the prediction and pick (at the step's first MoE
  // layer's start, or at the previous MoE layer's router); after the
  // router, the copies ahead of this layer and the staged row pointers.
  bool prefetches(const DLayer& d) const;
  void prefetch_pick(const DLayer& d);
  // Returns the layer's sequence number (0: nothing copied).
  unsigned prefetch_copy(const DLayer& d, int mi);
  // The DLayer of MoE layer mi + 1 when its experts are copied ahead, else null.
  const DLayer* next_moe(int mi) const;
  // After the layer's expert kernels are enqueued: waits for
  // stage_sel_kernel's list, copies the chosen host-tier experts on it, then
  // (prefetch_next) the next MoE layer's copies ahead.
  void prefetch_rest(unsigned seq, int mi);
  // On the copy stream, after the copies into staging slot p: its flag = seq.
  void flag_copied(int p, unsigned seq);
  // The MoE layer whose after-router copies are still to issue (0: none):
  // release_copies() issues them right after the layer's gate_up launch.
  unsigned rest_seq = 0;
  int rest_mi = 0;
  void release_copies();
  // The copy engine's path on (n copies ahead per MoE layer, 0-4; next:
  // predicted at the previous MoE layer's router) or off (the zero-copy
  // kernels); on, the decode step runs as plain launches (upload.cu). Off
  // where the model has no host tier of q4/q8 experts (or a disk tier).
  void set_host_copies(bool on, int n, bool next);
  // Disk tier, after the routing of MoE layer mi: the chosen experts
  // resident (read from disk where needed) before its expert kernels.
  void disk_fetch(int mi);
  // The n expert ids at d_ids (device) of MoE layer mi resident, tables set on the stream.
  void fetch_experts(int mi, const int* d_ids, int n);

  // graph.cu, state.cu, forward.cu
  void run_step(CudaState::Impl& s, int kind);
  // Full retention: grow the KV storage (and scores) to hold `slots`.
  void ensure_cap(CudaState::Impl& s, int64_t slots);
  // snapkv.cu: a state of --kv-snapkv B about to take its first
  // single-token step cuts each layer's prompt to B positions (the CPU's
  // choice); a no-op for every other state, and once done.
  void snapkv_begin_decode(CudaState::Impl& s);
  // A snapshot's cut state: B empty slots per layer in the cut layout
  // (positions counted from shift), for load_state to fill.
  void snapkv_restore(CudaState::Impl& s, int64_t shift);
  // The state-wide part of the cut layout (cap, window, sinks; the query
  // rings freed, the scores sized for B).
  void snapkv_layout(CudaState::Impl& s, int64_t shift);
  // The batched prefill, made at its first use; null where it cannot run
  // (switched off, shapes it does not cover, no device memory left for its
  // buffers): token by token then.
  Prefill* batched();
  // Puts ids[0..n) into the device ring at positions pos.. (base = pos).
  void put_ids(CudaState::Impl& s, const int32_t* ids, int64_t n);
  // What the batched prefill reads and writes of state s (its KV layers,
  // conv and delta states, retention scores, position).
  PrefillState prefill_state(CudaState::Impl& s) const;

  // forward_batch.cu
  // Whether n prompt tokens of s can share a prefill pass with other
  // sequences' (prompt_rows), else they take forward().
  bool prompt_rows_fit(CudaState::Impl& s, int64_t n, LogitsMode mode);
  // The prompt chunks of S items in one pass (Prefill::run_rows), their
  // last rows' logits / argmax as asked.
  void prompt_rows(const CudaBatchItem* const* its, int S);
  int* prompt_ids = nullptr;  // [chunk] their ids on the device (alloc'd at first use)

  // verify.cu
  // Whether n tokens fed to state s take the verify pass: a drafting state,
  // 2..kVerifyRows tokens, a full KV cache, shapes the batched step covers.
  bool verify_fits(CudaState::Impl& s, int64_t n);
  // The verify pass: n tokens through Prefill::step_batch as rows of s
  // (VerifyRows), the head kept in step, the states after each row kept for
  // take_back; the logits as forward() (mode, out) and, where best is not
  // null, each row's argmax picked on the device (best[n]). Synchronizes.
  void verify(CudaState::Impl& s, const int32_t* ids, int64_t n, LogitsMode mode, float* out, int32_t* best);
  // The buffers of those kept states and take_back's copies, at first use.
  void keep_verify_rows(CudaState::Impl& s);

  // mtp.cu
  std::unique_ptr<DeviceMtp> mtp;  // when the checkpoint has an MTP head
  void upload_mtp(const QwenModel& model);
  // The head's activations, token and drafts buffers (a loaded head and a
  // synthetic one alike).
  void alloc_mtp_buffers(DeviceMtp& d);
  // A KV layer of state s's shape and capacity (state.cu), allocated.
  KvLayer new_kv_layer(const CudaState::Impl& s) const;
  // The head once on (hidden [H], the token at *tok) at head position hpos:
  // input kernel, fc, the layer's attention (its KV entry at hpos written);
  // full: also its FFN, the final norm into mtp->out and the logits.
  void head_step(CudaState::Impl& hs, const float* hidden, const int* tok, int hpos, bool full);
  // After the main model consumed the token at *tok (device) at position
  // pos with residual x_last: the head entry pos-1 (from head_hidden and the
  // token) when pos > 0, and head_hidden = final_norm(x_last).
  void advance_head(CudaState::Impl& s, const int* tok, int64_t pos, const float* x_last);
};

// The Impl of a CudaModel, and a new empty CudaModel: for the units of this
// backend outside the class (cuda_bench.cu).
struct CudaModelAccess {
  static CudaModel::Impl& impl(const CudaModel& m) { return *m.p_; }
  static std::unique_ptr<CudaModel> make() { return std::unique_ptr<CudaModel>(new CudaModel); }
};

}  // namespace flashmoe
