// Batched prefill on the GPU: a chunk of prompt tokens through the model
// layer by layer (as the CPU backend does), so each weight row is read once
// per chunk instead of once per token:
//  - every projection is a matrix product on the tensor cores (gemm.cuh);
//  - conv1d and the delta rule walk the chunk's tokens in order, the state
//    in registers (prefill_kernels.cuh);
//  - attention runs all of the chunk's queries at once, causal over the
//    cache and the chunk;
//  - the routed experts get per-expert token lists built on the device, and
//    each chosen expert is read once per chunk (grouped product).
// Used by CudaModel::forward for more than one token at a time; decode
// (one token) keeps the graph-captured step of decode_step.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <functional>
#include <utility>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/device_model.cuh"
#include "format/config.h"
#include "model/plan.h"

namespace flashmoe::cuda {

struct GemmArgs;

// Phases of the profile (DecodeOptions::prefill_profile): kPhase in prefill.cu names them.
enum PrefillPhase {
  P_NORM, P_INPROJ, P_CONV, P_DELTA_PRE, P_DELTA_SCAN, P_GATED_NORM, P_OUTPROJ, P_ATTN_PREP, P_ATTN, P_ROUTER,
  P_ROUTE, P_EXPERTS_GU, P_EXPERTS_DOWN, P_SHARED, P_COMBINE, P_OTHER, P_N
};

// Activations split into hi/lo bf16 rows for gemm_pipe_kernel (null: none).
struct SplitRows {
  const __nv_bfloat16* hi = nullptr;
  const __nv_bfloat16* lo = nullptr;
};
// Rows a product writes split (GemmArgs::Chi / Clo).
struct SplitOut {
  __nv_bfloat16* hi = nullptr;
  __nv_bfloat16* lo = nullptr;
  operator SplitRows() const { return {hi, lo}; }
};

// What the prefill reads of the uploaded model.
struct PrefillModel {
  const ModelConfig* c = nullptr;
  const std::vector<DLayer>* L = nullptr;
  const ModelPlan* plan = nullptr;  // the layers in order, with their state and MoE slots
  DMat embed, lm_head;
  const float* final_norm = nullptr;
  const float* inv_freq = nullptr;
  cudaStream_t stream = nullptr;
  bool profile = false;  // DecodeOptions::prefill_profile
  bool batch_graph = false;  // DecodeOptions::batch_graph
  int batch_experts = 0;     // DecodeOptions::batch_experts
  // Disk tier: called after the routing of MoE layer mi (d_ids: the chunk's
  // T * k choices, on the device); returns with every chosen expert resident
  // and its table entry set on the stream. Null: all experts are resident.
  std::function<void(int mi, const int* d_ids, int n)> experts_needed;
  // Tiers without disk: before MoE layer mi's grouped experts over a chunk
  // of T tokens, the tables to read them through (ExpertTiers::stage), or
  // {null, null} for the layer's own. Null: the layer's own.
  std::function<std::pair<const void* const*, const void* const*>(int mi, int T)> stage_experts;
  // Expert parallelism over several GPUs (multi_gpu.cu): around each routed
  // MoE's experts over T rows of x (T x hidden): moe_before keeps the
  // residual, moe_after all-reduces the experts' sums into x. Null: one GPU.
  std::function<void(float* x, int T)> moe_before, moe_after;
};

// One conversation's device state, advanced by a chunk.
struct PrefillState {
  const std::vector<KvLayer>* kvl = nullptr;
  const std::vector<float*>* conv = nullptr;  // [C][K-1] per linear layer
  const std::vector<float*>* ssm = nullptr;   // [nv][dk][dv] per linear layer
  int kvt = KV_F32, ns = 0;
  size_t el = 4;  // bytes per KV element
  int* d_pos = nullptr;
  // h2o chunks that evict (attention token by token, as the decode step):
  float* scores = nullptr;  // the decode step's [nh][cap] scratch
  int attn_split = 1;       // attn_kernel's blocks per head for this cache
  // snapkv before decoding: per full-attention layer a ring [kSnapObserved][nh*hd]
  // that takes the chunk's last queries (the query of position p at row p % kSnapObserved).
  float* const* snap_q = nullptr;
};

// A verify pass of speculative decoding through step_batch: its rows are
// consecutive tokens of ONE sequence (seqs[0]) at positions p0, p0 + 1, ..
// Attention is causal over them (every row's K/V is stored before any row
// attends, and row t reads up to its own position: a full cache only, not
// h2o); conv1d and the delta rule walk the rows in order, and the
// recurrent states after each row t < B - 1 are kept, at conv_rows[l] +
// t * C * (K - 1) and ssm_rows[l] + t * nv * dk * dv floats for linear
// layer l, so a rejected draft rolls back by a copy (CudaModel::take_back).
// Each row attends with its own scores scratch (scores + t * scores_row
// floats): the rows run concurrently, so one [nh][cap] scratch shared by
// them would mix their scores.
struct VerifyRows {
  int64_t p0 = 0;
  const std::vector<float*>* conv_rows = nullptr;
  const std::vector<float*>* ssm_rows = nullptr;
  float* scores = nullptr;
  size_t scores_row = 0;
};

// The sequences of one pass (Prefill::run_rows): sequence j has the
// pass's rows [r0[j], r0[j + 1]), seq[r] is the sequence of row r, and
// conv[j] / ssm[j] are its states of the layer at hand. Every sequence's
// recurrence goes in one launch: five launches per sequence and layer made
// a many-prompt step launch-bound (the 35B: a step of 14 short prompts took
// 76 ms; bench/NOTES.md, "Session 19: where the GPU server's time to first
// token goes").
struct PassSeqs {
  const int* r0 = nullptr;        // [S + 1]
  const int* seq = nullptr;       // [R]
  float* const* conv = nullptr;   // [S]: [C][K-1]
  float* const* ssm = nullptr;    // [S]: [nv][dk][dv]
};

// One sequence's part of a prefill pass over several (Prefill::run_rows):
// its state, its rows [r0, r0 + T) of the pass, the position of row r0.
struct PromptRows {
  PrefillState s;
  int r0 = 0, T = 0;
  int64_t pos = 0;
};

class Prefill {
 public:
  // Why the batched path cannot run this model (empty: it can); the caller
  // then feeds token by token.
  static std::string unsupported(const PrefillModel& m);
  // Allocates the buffers of chunks of up to max_tokens tokens (throws Error
  // when the device is out of memory).
  Prefill(const PrefillModel& m, int max_tokens);
  ~Prefill();
  Prefill(const Prefill&) = delete;
  Prefill& operator=(const Prefill&) = delete;

  int max_tokens() const { return tmax_; }
  // step_batch through CUDA graphs (DecodeOptions::batch_graph) or plain launches.
  void set_batch_graph(bool on) { batch_graph_ = on; }
  // The routed experts' product: chosen per step by the rows per picked
  // expert (few_rows_experts), or one path forced (DecodeOptions::batch_experts).
  void set_expert_path(int path) {
    expert_path_ = path;
    drop_batch_graphs();  // captured with the other path
  }
  // Tokens d_ids[0..T) (device) at positions pos..pos+T-1 through every
  // layer, T <= max_tokens(); *d_pos becomes pos + T. Enqueued on the stream.
  // A chunk that makes an h2o cache evict runs its attention token by token.
  void run(const PrefillState& s, const int* d_ids, int T, int64_t pos);
  // The prompt chunks of S sequences in one pass: rows d_ids[0..R) (device),
  // R = the sum of their T <= max_tokens(), sequence j's at rows [r0, r0 +
  // T) in order. Every product and each chosen expert runs once over all R
  // rows; conv1d, the delta rule and attention per sequence over its own
  // rows, state and cache; each *d_pos moves on by its T. Attention in
  // order (in_order) takes one sequence alone (run).
  void run_rows(const PromptRows* seqs, int S, const int* d_ids);
  // Whether a chunk of T tokens at p0 attends token by token
  // (attend_in_order): an h2o cache that evicts in it (each victim depends
  // on the scores of every token before), or a Quest store past its
  // resident budget (each query chooses its own pages).
  static bool in_order(const KvLayer& kv, int p0, int T);
  // Row rows[i] of the last pass's residual stream to row i, for i < n
  // (rows rising, rows[i] >= i), so that logits_rows reads them as its first n.
  void gather_rows(const int* rows, int n);
  // The residual stream of the last chunk's token t after the last layer (device, [H]).
  const float* hidden(int t) const;
  // Logits of the last chunk's tokens [t0, t0 + n) into host memory dst ([n][V]); synchronizes.
  void logits(int t0, int n, float* dst);

  // One decode step over B independent sequences (continuous batching),
  // B <= max_tokens(): token ids[b] (host) of sequence seqs[b] at its own
  // position *seqs[b].d_pos, which moves on by one. The products and the
  // routed experts run over the B rows at once (each weight, each chosen
  // expert read once per step); conv1d, the delta rule and attention per
  // sequence over its own state and KV cache (batch_kernels.cuh: the decode
  // step's kernel bodies, one launch per layer for all of them). Enqueued
  // on the stream (batch_step.cu).
  // verify: B rows of seqs[0] instead (VerifyRows).
  void step_batch(const PrefillState* seqs, int B, const int32_t* ids, const VerifyRows* verify = nullptr);
  // Logits of the last step's (or chunk's) rows [0, n): row r into host
  // memory dst[r] ([V]) through one copy to pinned memory, and the argmax of
  // row r (ties: the lower id) picked on the device into *best[r]; rows with
  // a null dst / best skipped; synchronizes.
  void logits_rows(int n, float* const* dst, int32_t* const* best);

 private:
  // On stream s (null: the model's stream).
  void gemm(int dt, const GemmArgs& a, int bm, int grid_y, SplitRows sp = {}, cudaStream_t s = nullptr);
  // Rows per tile of the tiled product: fewer where few rows share a weight
  // tile (the routed experts at small chunks), so the tensor cores pad less.
  static int tile_rows(double rows) { return rows >= 48 ? 64 : rows >= 20 ? 32 : 16; }
  // The lm_head over `rows` normed rows (xn_) into logits_ (logits and
  // logits_rows; each picks its kernel).
  GemmArgs lm_head_args(int rows) const;
  // C[T][..] (=, +=, swiglu) = A[T][K] . W^T (sp: A already split). side:
  // on side_, splitting A (where needed) into the side's own hi/lo rows.
  // out (swiglu): C also split into these hi/lo rows, where given.
  void dense_rows(const DMat& W, const float* A, int T, float* C, int ldc, int mode, int half = 0, SplitRows sp = {},
                  bool side = false, SplitOut out = {});
  // x_[t] = embed[d_ids[t]], and y[t] = rms_norm(x[t]) * (1 + w), for T rows.
  void embed_rows(const int* d_ids, int T);
  template <typename E>
  void embed_rows_as(const int* d_ids, int T);  // embed_rows of an embedding stored as E (prefill.cu)
  void norm_rows(const float* x, const float* w, int T, float* y);
  // xn_ = norm_rows(x, w), and xn_ split into xhi_ / xlo_.
  void norm_split_rows(const float* x, const float* w, int T);
  // Threads per block of the kernels with a block per row (norms, the
  // expert combine): 1024 where the T blocks leave most SMs idle (a batched
  // decode step: each row's loads spread over 4x the warps), else 256.
  int row_threads(int T) const { return T < sms_ ? 1024 : 256; }
  // The feed-forward of layer l (dense or routed) over the T rows of x_.
  // next_norm (null: none): the next layer's input norm weights; a routed
  // feed-forward then also leaves rms_norm(x_) * (1 + next_norm) in xn_ and
  // returns true.
  bool feed_forward(const LayerPlan& l, const DLayer& d, int T, const float* next_norm = nullptr);
  // Whether T rows' routed experts stored as edt take few_rows_kernel
  // (few_rows_experts.cuh) instead of the tiled product.
  bool few_rows_experts(int T, int edt) const;
  // Whether T rows' routed experts stored as edt take skinny_gemm_kernel
  // (grouped, tiles of kSkinnyExpertRows rows); checked before few_rows_experts.
  bool skinny_experts(int T, int edt) const;
  // step_batch's per-sequence kernel arguments for the whole step, written
  // to pinned host memory and copied to the device in one transfer.
  void* batch_args(size_t bytes);
  // Whether skinny_gemm_kernel (gemm_skinny.cuh: a few rows over bf16
  // weights) can run A[T][K] . W^T, and whether the dense product in
  // `mode` takes it (where measured faster than the tiled product).
  static bool skinny_fits(const DMat& W, const float* A, int T);
  bool skinny(const DMat& W, const float* A, int T, int mode) const;
  void skinny_gemm(const GemmArgs& a, cudaStream_t s = nullptr);
  // bf16 weights take the pipelined product (gemm_pipe_kernel), the others gemm_kernel.
  static bool pipe(int dt) { return dt == DT_BF16; }
  // A [rows][cols] into the hi/lo pair y, or (side) the side stream's pair
  // on side_. (xn_'s pair x comes from its norm: norm_split_rows.)
  SplitRows split(const float* A, int rows, int cols, bool side = false);
  void allocate();
  void* alloc(size_t bytes);
  // The chunk's rows [r0, r0 + T) of the pass (run_rows) at positions p0..
  void attend_chunk(const PrefillState& s, const DLayer& d, const KvLayer& kv, int p0, int T, int r0);
  void attend_in_order(const PrefillState& s, const DLayer& d, const KvLayer& kv, int T);
  void observe_queries(float* ring, const float* q, int p0, int T);  // snapkv (PrefillState::snap_q)
  // The pass's sequences to the device: rows, and each linear layer's
  // states at pass_conv_ / pass_ssm_ + slot * S (the returned tables' rows).
  PassSeqs upload_pass(const PromptRows* seqs, int S, int R);
  // h2o: room for the chunk's partial score sums (grows with the context).
  float* h2o_part(size_t floats);
  void mark(int phase);  // with the profile: an event after a phase's kernels (the first: the start)
  void report();

  // Profile (DecodeOptions::prefill_profile): time per phase summed over
  // chunks, printed to stderr when the prefill is destroyed.
  bool profile_ = false;
  bool batch_graph_ = false;
  int expert_path_ = 0;  // DecodeOptions::BatchExperts
  bool stepping_ = false;  // inside step_batch (PDL applies)
  // Whether a launch of the batched decode step goes out with programmatic
  // dependent launch (not under the profile: its events sit between kernels).
  bool pdl() const { return stepping_ && !profile_; }
  // kern<<<grid, block, smem, s>>>(args...), with PDL where pdl(): a kernel
  // sent this way must wait in pdl_wait() before it reads or overwrites
  // what the kernels before it use.
  template <typename... K, typename... A>
  void send(void (*kern)(K...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl() ? 1 : 0;
    check(cudaLaunchKernelEx(&cfg, kern, args...), "batched prefill / decode step: launch");
  }
  // The shared expert's stream and its fork / join with m_.stream (each
  // record is a dependency edge when the step is captured in a graph).
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  int max_smem_ = 48 * 1024;  // opt-in shared memory per block
  std::vector<cudaEvent_t> events_;
  std::vector<int> event_phase_;
  std::vector<double> phase_ms_, step_ms_;  // run()'s chunks, step_batch's steps
  int chunks_ = 0, tokens_ = 0, steps_ = 0, step_tokens_ = 0;
  // The profiled time between the events recorded since the last clear, per phase, into ms.
  void collect(std::vector<double>& ms);

  PrefillModel m_;
  int tmax_ = 0, lrows_ = 0, tiles_max_ = 0, sms_ = 1;
  size_t pass_slots_ = 0;  // linear layers: the recurrent states a sequence holds
  int* pass_r0_ = nullptr;        // [tmax_ + 1]
  int* pass_seq_ = nullptr;       // [tmax_]
  float** pass_conv_ = nullptr;   // [slots][tmax_]
  float** pass_ssm_ = nullptr;    // [slots][tmax_]
  std::vector<void*> allocs_;
  float *x_ = nullptr, *xn_ = nullptr, *proj_ = nullptr, *cv_ = nullptr, *o_ = nullptr, *q_ = nullptr;
  float *beta_ = nullptr, *decay_ = nullptr, *rl_ = nullptr, *w_ = nullptr, *hb_ = nullptr, *hs_ = nullptr;
  float *y_ = nullptr, *ysh_ = nullptr, *logits_ = nullptr, *lse_ = nullptr;
  int* seq_ = nullptr;  // positions p0 + t of the chunk's tokens (attend_in_order)
  int *ids_ = nullptr, *tok_ = nullptr, *dest_ = nullptr, *tiles_ = nullptr, *ntiles_ = nullptr;
  int* tile_done_ = nullptr;  // per tile: gate/up's finished blocks (GemmArgs::tile_done)
  __nv_bfloat16 *xhi_ = nullptr, *xlo_ = nullptr, *yhi_ = nullptr, *ylo_ = nullptr;
  __nv_bfloat16 *shi_ = nullptr, *slo_ = nullptr;  // the shared expert's down input, split on side_
  float* h2o_part_ = nullptr;
  size_t h2o_part_n_ = 0;
  KvLayer stage_{};  // a windowed cache's K/V of the chunk until its queries ran
  int proj_stride_ = 0, o_stride_ = 0;
  // logits_rows' pinned host rows [lrows_][V] and argmax ids (allocated at first use).
  float* logits_host_ = nullptr;
  int* best_host_ = nullptr;
  int* best_dev_ = nullptr;
  void* args_host_ = nullptr;  // pinned
  void* args_dev_ = nullptr;
  size_t args_n_ = 0;
  // step_batch's graphs by batch shape (they read args_dev_: dropped when it moves).
  std::map<std::string, cudaGraphExec_t> batch_graphs_;
  std::set<std::string> batch_shapes_seen_;  // shapes stepped at least once (the second step captures)
  void drop_batch_graphs();
};

}  // namespace flashmoe::cuda
