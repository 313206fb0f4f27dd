// Batched prefill (see prefill.cuh): the host side, one chunk of tokens
// through every layer with the kernels of gemm.cuh and prefill_kernels.cuh.
#include "backend/cuda/prefill.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/few_rows_experts.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/gemm_pipe.cuh"
#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/gguf_kernels.cuh"
#include "backend/cuda/prefill_kernels.cuh"
#include "backend/cuda/quest.cuh"
#include "kv/kv_config.h"

namespace flashmoe::cuda {

namespace {
const char* kPhase[P_N] = {"norms", "in-proj / qkv", "conv1d", "delta prep (q/k norms, gates)", "delta scan",
                           "gated norm", "out-proj / o_proj", "attn prep (rope, KV write)", "attention",
                           "router", "top-k + expert lists", "experts gate/up", "experts down",
                           "shared expert / mlp", "expert combine", "embed, commit, other"};
int div_up(int64_t a, int64_t b) { return int((a + b - 1) / b); }
}  // namespace

std::string Prefill::unsupported(const PrefillModel& m) {
  const ModelConfig& c = *m.c;
  const int64_t dk = c.lin_k_dim, dv = c.lin_v_dim;
  bool linear = false, full = false;
  for (const LayerPlan& l : m.plan->layers) (l.mixer == MixerKind::GatedAttention ? full : linear) = true;
  if (full && (c.head_dim % 8 != 0 || c.head_dim > 256)) return "attention head_dim not a multiple of 8 up to 256";
  if (linear) {
    if (dk != 32 && dk != 64 && dk != 128 && dk != 256) return "linear-attention key dim not 32, 64, 128 or 256";
    if (dv % 32 != 0 || dv > 1024) return "linear-attention value dim not a multiple of 32 up to 1024";
    if (c.conv_kernel < 1 || c.conv_kernel > 8) return "conv kernel outside 1..8";
  }
  return "";
}

float* Prefill::h2o_part(size_t floats) {
  if (floats > h2o_part_n_) {
    cudaStreamSynchronize(m_.stream);  // no kernel in flight reads the old one
    cudaFree(h2o_part_);
    h2o_part_ = nullptr;
    h2o_part_n_ = 0;
    h2o_part_ = static_cast<float*>(dev_alloc(floats * 4, "the batched prefill's h2o scores"));
    h2o_part_n_ = floats;
  }
  return h2o_part_;
}

void* Prefill::alloc(size_t bytes) {
  void* p = dev_alloc(bytes, "the batched prefill's buffers");
  allocs_.push_back(p);
  return p;
}

Prefill::Prefill(const PrefillModel& m, int max_tokens) : m_(m), tmax_(max_tokens) {
  profile_ = m.profile;
  batch_graph_ = m.batch_graph;
  expert_path_ = m.batch_experts;
  phase_ms_.assign(P_N, 0.0);
  step_ms_.assign(P_N, 0.0);
  auto smem = [](auto kern, size_t bytes) {
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  };
  smem(gemm_pipe_kernel<64, 32>, PipeShape<64, 32>::kSmem);
  smem(gemm_pipe_kernel<32, 64>, PipeShape<32, 64>::kSmem);
  smem(gemm_pipe_kernel<16, 64>, PipeShape<16, 64>::kSmem);
  int dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&max_smem_, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  try {
    allocate();
  } catch (...) {  // out of device memory: nothing kept
    for (void* p : allocs_) cudaFree(p);
    throw;
  }
  CK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
}

void Prefill::allocate() {
  const PrefillModel& m = m_;
  const ModelConfig& c = *m.c;
  const size_t T = size_t(tmax_), H = size_t(c.hidden_size);
  int rmax = 1, omax = 1, is_max = 1, rl = 1;
  for (const DLayer& l : *m.L) {
    rmax = std::max({rmax, l.lin_in.rows, l.qkv.rows});
    omax = std::max({omax, l.out_proj.cols, l.o_proj.cols});
    is_max = std::max(is_max, l.s_down.cols);
    rl = std::max(rl, l.router.rows);
  }
  proj_stride_ = rmax;
  o_stride_ = omax;
  const size_t k = size_t(std::max<int64_t>(1, c.num_experts_per_tok));
  const size_t I = size_t(std::max<int64_t>(1, c.moe_intermediate));
  const size_t C = size_t(std::max<int64_t>(1, c.lin_conv_dim())), nv = size_t(std::max<int64_t>(1, c.lin_num_v_heads));
  const size_t qn = size_t(std::max<int64_t>(1, c.num_heads * c.head_dim));
  auto f = [&](size_t n) { return static_cast<float*>(alloc(n * 4)); };
  auto i = [&](size_t n) { return static_cast<int*>(alloc(n * 4)); };
  x_ = f(T * H);
  xn_ = f(T * H);
  proj_ = f(T * size_t(rmax));
  cv_ = f(T * C);
  o_ = f(T * size_t(omax));
  q_ = f(T * qn);
  beta_ = f(T * nv);
  decay_ = f(T * nv);
  rl_ = f(T * size_t(rl));
  w_ = f(T * (k + 1));
  ids_ = i(T * k);
  tok_ = i(T * k);
  dest_ = i(T * k);
  // Tiles of 16 rows (the tiled product) or of kFewRows (few_rows_kernel).
  tiles_max_ = int(T * k / kFewRows + size_t(std::max<int64_t>(1, c.num_experts)) + 1);
  tiles_ = i(size_t(3) * tiles_max_);
  ntiles_ = i(1);
  tile_done_ = i(size_t(tiles_max_));
  hb_ = f(T * k * I);
  hs_ = f(T * size_t(is_max));
  y_ = f(T * k * H);
  ysh_ = f(T * H);
  const size_t ymax = std::max({T * size_t(omax), T * k * I, T * size_t(is_max)});
  auto b = [&](size_t n) { return static_cast<__nv_bfloat16*>(alloc(n * 2)); };
  xhi_ = b(T * H);
  xlo_ = b(T * H);
  yhi_ = b(ymax);
  ylo_ = b(ymax);
  shi_ = b(T * size_t(is_max));
  slo_ = b(T * size_t(is_max));
  lrows_ = std::min(tmax_, 32);
  logits_ = f(size_t(lrows_) * size_t(c.vocab_size));
  const size_t row = size_t(std::max<int64_t>(1, c.num_kv_heads * c.head_dim));
  stage_.k = alloc(T * row * 4);
  stage_.v = alloc(T * row * 4);
  stage_.ks = f(T * 64);
  stage_.vs = f(T * 64);
  stage_.cap = tmax_;
  lse_ = f(T * size_t(std::max<int64_t>(1, c.num_heads)));
  seq_ = i(T);
  best_dev_ = i(size_t(lrows_));
  // A pass's sequences (PassSeqs): at most one a row.
  pass_slots_ = size_t(std::count_if(m_.plan->layers.begin(), m_.plan->layers.end(),
                                     [](const LayerPlan& l) { return l.mixer != MixerKind::GatedAttention; }));
  pass_r0_ = i(T + 1);
  pass_seq_ = i(T);
  pass_conv_ = static_cast<float**>(alloc(std::max<size_t>(1, pass_slots_) * T * sizeof(float*)));
  pass_ssm_ = static_cast<float**>(alloc(std::max<size_t>(1, pass_slots_) * T * sizeof(float*)));
}

PassSeqs Prefill::upload_pass(const PromptRows* seqs, int S, int R) {
  const size_t slots = seqs[0].s.conv ? seqs[0].s.conv->size() : 0;
  if (slots > pass_slots_) fail("batched prefill: more recurrent states than the model's linear layers");
  std::vector<int> r0(size_t(S) + 1), seq(static_cast<size_t>(R));
  std::vector<float*> conv(slots * size_t(S)), ssm(slots * size_t(S));
  for (int j = 0; j < S; ++j) {
    const PrefillState& s = seqs[j].s;
    if (slots && (s.conv->size() != slots || s.ssm->size() != slots))
      fail("batched prefill: sequences with different numbers of recurrent states");
    r0[size_t(j)] = seqs[j].r0;
    for (int r = seqs[j].r0; r < seqs[j].r0 + seqs[j].T; ++r) seq[size_t(r)] = j;
    for (size_t sl = 0; sl < slots; ++sl) {
      conv[sl * size_t(S) + size_t(j)] = (*s.conv)[sl];
      ssm[sl * size_t(S) + size_t(j)] = (*s.ssm)[sl];
    }
  }
  r0[size_t(S)] = R;
  // From pageable memory: each copy has left the vectors when it returns.
  auto up = [&](void* dst, const void* src, size_t bytes) {
    if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, m_.stream), "batched prefill: sequences");
  };
  up(pass_r0_, r0.data(), r0.size() * sizeof(int));
  up(pass_seq_, seq.data(), seq.size() * sizeof(int));
  up(pass_conv_, conv.data(), conv.size() * sizeof(float*));
  up(pass_ssm_, ssm.data(), ssm.size() * sizeof(float*));
  PassSeqs p;
  p.r0 = pass_r0_;
  p.seq = pass_seq_;
  return p;
}

Prefill::~Prefill() {
  cudaStreamSynchronize(m_.stream);
  cudaStreamSynchronize(side_);
  cudaEventDestroy(fork_);
  cudaEventDestroy(join_);
  cudaStreamDestroy(side_);
  if (profile_) report();
  for (auto e : events_) cudaEventDestroy(e);
  for (void* p : allocs_) cudaFree(p);
  cudaFree(h2o_part_);
  drop_batch_graphs();
  cudaFree(args_dev_);
  cudaFreeHost(args_host_);
  cudaFreeHost(logits_host_);
  cudaFreeHost(best_host_);
}

void Prefill::mark(int phase) {
  if (!profile_) return;
  const size_t i = event_phase_.size();
  if (events_.size() <= i) {
    cudaEvent_t e;
    CK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  CK(cudaEventRecord(events_[i], m_.stream));
  event_phase_.push_back(phase);
}

void Prefill::collect(std::vector<double>& ms) {
  CK(cudaStreamSynchronize(m_.stream));
  for (size_t i = 1; i < event_phase_.size(); ++i) {
    float t = 0;
    CK(cudaEventElapsedTime(&t, events_[i - 1], events_[i]));
    ms[size_t(event_phase_[i])] += t;
  }
}

void Prefill::report() {
  auto table = [](const std::vector<double>& ms, double total) {
    for (int p = 0; p < P_N; ++p)
      if (ms[size_t(p)] > 0)
        std::fprintf(stderr, "  %-32s %9.3f ms  %5.1f%%\n", kPhase[p], ms[size_t(p)], 100 * ms[size_t(p)] / total);
  };
  double total = 0, steps = 0;
  for (double v : phase_ms_) total += v;
  for (double v : step_ms_) steps += v;
  if (chunks_ > 0) {
    std::fprintf(stderr, "batched prefill profile: %d chunks, %d tokens, %.2f ms (%.0f tokens/s in the kernels)\n",
                 chunks_, tokens_, total, total > 0 ? tokens_ / total * 1e3 : 0.0);
    table(phase_ms_, total);
  }
  if (steps_ > 0) {
    std::fprintf(stderr, "batched decode profile: %d steps, %d tokens, %.3f ms per step (%.0f tokens/s in the kernels)\n",
                 steps_, step_tokens_, steps / steps_, steps > 0 ? step_tokens_ / steps * 1e3 : 0.0);
    table(step_ms_, steps);
  }
}

const float* Prefill::hidden(int t) const { return x_ + size_t(t) * m_.c->hidden_size; }

SplitRows Prefill::split(const float* A, int rows, int cols, bool side) {
  __nv_bfloat16* hi = side ? shi_ : yhi_;
  __nv_bfloat16* lo = side ? slo_ : ylo_;
  const int blocks = std::min(div_up(int64_t(rows) * cols, 256), sms_ * 8);
  send(split_rows_kernel, dim3(unsigned(blocks)), dim3(256), 0, side ? side_ : m_.stream, A, rows, cols, cols, hi, lo);
  return {hi, lo};
}

void Prefill::gemm(int dt, const GemmArgs& a, int bm, int grid_y, SplitRows sp, cudaStream_t s) {
  if (!s) s = m_.stream;
  if (pipe(dt) && sp.hi) {
    const dim3 grid(unsigned(pipe_blocks_x(a)), unsigned(std::max(grid_y, 1)));
    auto go = [&](auto kern, size_t smem) { send(kern, grid, dim3(kPipeThreads), smem, s, a, sp.hi, sp.lo); };
    // 64 columns of K per stage paid on every product but the tallest tiles
    // (64 rows: 140 registers and 110 KB per block, 2 blocks per SM), where
    // 32 was faster (bench/NOTES-cuda.md, prefill).
    if (bm == 64) go(gemm_pipe_kernel<64, 32>, PipeShape<64, 32>::kSmem);
    else if (bm == 32) go(gemm_pipe_kernel<32, 64>, PipeShape<32, 64>::kSmem);
    else go(gemm_pipe_kernel<16, 64>, PipeShape<16, 64>::kSmem);
    check(cudaGetLastError(), "batched prefill: matrix product");
    return;
  }
  const int gx = a.mode == GEMM_SWIGLU ? div_up(a.half, kGemmBN / 2) : div_up(a.N, kGemmBN);
  const dim3 grid(unsigned(gx), unsigned(std::max(grid_y, 1)));
  auto go = [&](auto kern) { kern<<<grid, kGemmThreads, 0, s>>>(a); };
  switch (dt * 3 + (bm == 64 ? 2 : bm == 32 ? 1 : 0)) {
    case DT_F32 * 3 + 0: go(gemm_kernel<float, 16>); break;
    case DT_F32 * 3 + 1: go(gemm_kernel<float, 32>); break;
    case DT_F32 * 3 + 2: go(gemm_kernel<float, 64>); break;
    case DT_F16 * 3 + 0: go(gemm_kernel<__half, 16>); break;
    case DT_F16 * 3 + 1: go(gemm_kernel<__half, 32>); break;
    case DT_F16 * 3 + 2: go(gemm_kernel<__half, 64>); break;
    case DT_BF16 * 3 + 0: go(gemm_kernel<__nv_bfloat16, 16>); break;
    case DT_BF16 * 3 + 1: go(gemm_kernel<__nv_bfloat16, 32>); break;
    case DT_BF16 * 3 + 2: go(gemm_kernel<__nv_bfloat16, 64>); break;
    case DT_Q4 * 3 + 0: go(gemm_kernel<QW<4>, 16>); break;
    case DT_Q4 * 3 + 1: go(gemm_kernel<QW<4>, 32>); break;
    case DT_Q4 * 3 + 2: go(gemm_kernel<QW<4>, 64>); break;
    case DT_Q8 * 3 + 0: go(gemm_kernel<QW<8>, 16>); break;
    case DT_Q8 * 3 + 1: go(gemm_kernel<QW<8>, 32>); break;
    case DT_GGUF * 3 + 0: go(gemm_kernel<GB, 16>); break;
    case DT_GGUF * 3 + 1: go(gemm_kernel<GB, 32>); break;
    case DT_GGUF * 3 + 2: go(gemm_kernel<GB, 64>); break;
    case DT_FP8 * 3 + 0: go(gemm_kernel<F8W, 16>); break;
    case DT_FP8 * 3 + 1: go(gemm_kernel<F8W, 32>); break;
    case DT_FP8 * 3 + 2: go(gemm_kernel<F8W, 64>); break;
    default: go(gemm_kernel<QW<8>, 64>); break;  // DT_Q8 * 3 + 2
  }
  check(cudaGetLastError(), "batched prefill: matrix product");
}

// Attention of a full-attention layer over the chunk: K/V of all its tokens
// into the cache (or the stage of a windowed one), all queries at once,
// h2o's scores from the same probabilities.
void Prefill::attend_chunk(const PrefillState& s, const DLayer& d, const KvLayer& kv, int p0, int T, int r0) {
  const ModelConfig& c = *m_.c;
  cudaStream_t st = m_.stream;
  const int nh = int(c.num_heads), nkv = int(c.num_kv_heads), hd = int(c.head_dim);
  // This sequence's rows of the pass (run_rows): [r0, r0 + T).
  float* const proj = proj_ + size_t(r0) * proj_stride_;
  float* const q = q_ + size_t(r0) * nh * hd;
  float* const o = o_ + size_t(r0) * nh * hd;
  float* const lse = lse_ + size_t(r0) * nh;
  const bool staged = kv.window > 0;
  KvLayer stage = stage_;
  stage.window = 0;
  stage.sinks = 0;
  stage.rot = kv.rot;  // attn_prep rotates what it stores there
  AttnPrepArgs p = attn_prep_args(c, d, proj, q, s.d_pos, m_.inv_freq, staged ? stage : kv, s.ns, s.kvt);
  p.tstride = proj_stride_;
  p.stage = staged ? p0 : -1;
  attn_prep_kernel<<<dim3(unsigned(nh + 1), unsigned(T)), 128, size_t(std::max(hd, 2 * nkv * hd)) * 4, st>>>(p);
  mark(P_ATTN_PREP);
  AttnRowsArgs a;
  a.q = q;
  a.gate = kv.rot ? nullptr : proj;  // rotated: gated by rot_gate_kernel below
  a.gstride = proj_stride_;
  a.out = o;
  a.kv = kv;
  a.stage = stage;
  if (!staged) a.stage.k = nullptr;
  a.p0 = p0;
  a.nh = nh;
  a.nkv = nkv;
  a.hd = hd;
  a.ns = s.ns;
  a.scale = 1.0f / std::sqrt(float(hd));
  const int group = nh / std::max(nkv, 1);
  // A block takes all query heads of one KV head (K/V rows shared through L1).
  a.hpb = group <= 8 && 8 % group == 0 ? group : 1;
  a.lse = kv.acc ? lse : nullptr;
  const dim3 g{unsigned(nh / a.hpb), unsigned(T)};
  switch (s.kvt) {
    case KV_F32: attn_rows_kernel<KV_F32><<<g, 256, 0, st>>>(a); break;
    case KV_BF16: attn_rows_kernel<KV_BF16><<<g, 256, 0, st>>>(a); break;
    case KV_F16: attn_rows_kernel<KV_F16><<<g, 256, 0, st>>>(a); break;
    default: attn_rows_kernel<KV_FP8><<<g, 256, 0, st>>>(a); break;
  }
  if (kv.acc) {  // h2o: the chunk's attention into the scores
    // tova: only the chunk's last query counts (its probabilities replace
    // the scores), so the product runs over that one token's rows.
    const int last = kv.latest_only ? T - 1 : 0, Tq = T - last;
    const int n = p0 + T, groups = div_up(int64_t(Tq) * (nh / nkv), kH2oTile * kH2oRowTiles);
    const dim3 g2{unsigned(div_up(n, kH2oTile)), unsigned(nkv * groups)};
    H2oRowsArgs h{q + size_t(last) * nh * hd, lse + size_t(last) * nh, h2o_part(size_t(g2.y) * size_t(n)), kv,
                  p0 + last, Tq, nh, nkv, hd, s.ns, groups, a.scale};
    switch (s.kvt) {
      case KV_F32: h2o_rows_part_kernel<KV_F32><<<g2, 256, 0, st>>>(h); break;
      case KV_BF16: h2o_rows_part_kernel<KV_BF16><<<g2, 256, 0, st>>>(h); break;
      case KV_F16: h2o_rows_part_kernel<KV_F16><<<g2, 256, 0, st>>>(h); break;
      default: h2o_rows_part_kernel<KV_FP8><<<g2, 256, 0, st>>>(h); break;
    }
    h2o_rows_sum_kernel<<<unsigned(div_up(n, 256)), 256, 0, st>>>(kv, h.part, int(g2.y), n);
  }
  if (kv.rot) rot_gate_kernel<<<dim3(unsigned(nh), unsigned(T)), 128, size_t(hd) * 4, st>>>(o, proj, proj_stride_, nh, hd);
  // quest (the whole chunk within the resident budget: full attention): the
  // bounds of the pages the chunk wrote.
  if (kv.quest)
    quest_bounds_kernel<<<quest_bounds_blocks(kv, nkv, p0, p0 + T), 256, 0, st>>>(kv, s.kvt, nkv, hd, s.ns, p0, p0 + T);
  mark(P_ATTN);
  if (staged) kv_commit_kernel<<<T, 256, 0, st>>>(kv, stage, p0, T, nkv * hd, s.ns, int(s.el));
  mark(P_OTHER);
}

// A launch that may begin while the previous kernel ends (programmatic
// dependent launch: the kernel waits for it before reading what it wrote),
// in clusters of `cluster` blocks.
template <typename... K, typename... A>
void launch_pdl(cudaStream_t st, void (*kern)(K...), int grid, int block, size_t smem, int cluster, A... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(unsigned(block));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  at[1].id = cudaLaunchAttributeClusterDimension;
  at[1].val.clusterDim = {unsigned(cluster), 1, 1};
  cfg.attrs = at;
  cfg.numAttrs = cluster > 1 ? 2 : 1;
  check(cudaLaunchKernelEx(&cfg, kern, args...), "batched prefill: attention in order");
}

// The same one token at a time, each through attn_prep, (quest's choice,)
// attn and h2o_acc as a decode step runs them (same victims, same scores,
// same pages), each launch overlapping the end of the one before.
void Prefill::attend_in_order(const PrefillState& s, const DLayer& d, const KvLayer& kv, int T) {
  const ModelConfig& c = *m_.c;
  cudaStream_t st = m_.stream;
  const int nh = int(c.num_heads), nkv = int(c.num_kv_heads), hd = int(c.head_dim);
  const int groups = std::max(8, 256 / hd);  // as the decode step
  const size_t prep_smem = size_t(std::max(hd, 2 * nkv * hd)) * 4, smem = size_t(2 * hd + groups * hd) * 4;
  for (int t = 0; t < T; ++t) {
    AttnPrepArgs p = attn_prep_args(c, d, proj_ + size_t(t) * proj_stride_, q_ + size_t(t) * nh * hd, seq_ + t,
                                    m_.inv_freq, kv, s.ns, s.kvt);
    launch_pdl(st, attn_prep_kernel, nh + 1, 128, prep_smem, 1, p);
    if (kv.quest) {  // this token's pages, as the decode step chooses them
      launch_pdl(st, quest_score_kernel, quest_score_blocks(kv, nkv), kQuestWarps * 32, size_t(nh / nkv) * hd * 4, 1,
                 kv, static_cast<const float*>(q_ + size_t(t) * nh * hd), static_cast<const int*>(seq_ + t), s.kvt, nh,
                 nkv, hd, s.ns);
      launch_pdl(st, quest_select_kernel, nkv, kQuestSelectThreads, 0, 1, kv, static_cast<const int*>(seq_ + t), nkv,
                 hd * int(s.el));
    }
    // Rotated (fp8 `rotated`): gated by rot_gate_kernel below.
    AttnArgs a = attn_args(c, q_ + size_t(t) * nh * hd, kv.rot ? nullptr : proj_ + size_t(t) * proj_stride_,
                           s.scores, o_ + size_t(t) * nh * hd, seq_ + t, kv, s.ns);
    a.split = s.attn_split;
    switch (s.kvt) {
      case KV_F32: launch_pdl(st, attn_kernel<KV_F32>, nh * a.split, 256, smem, a.split, a); break;
      case KV_BF16: launch_pdl(st, attn_kernel<KV_BF16>, nh * a.split, 256, smem, a.split, a); break;
      case KV_F16: launch_pdl(st, attn_kernel<KV_F16>, nh * a.split, 256, smem, a.split, a); break;
      default: launch_pdl(st, attn_kernel<KV_FP8>, nh * a.split, 256, smem, a.split, a); break;
    }
    if (kv.acc)
      launch_pdl(st, h2o_acc_kernel, div_up(kv.cap, 128), 128, 0, 1, kv, static_cast<const float*>(s.scores), nh,
                 static_cast<const int*>(seq_ + t));
  }
  if (kv.rot) rot_gate_kernel<<<dim3(unsigned(nh), unsigned(T)), 128, size_t(hd) * 4, st>>>(o_, proj_, proj_stride_, nh, hd);
  mark(P_ATTN);
}

template <typename E>
void Prefill::embed_rows_as(const int* d_ids, int T) {
  send(embed_rows_kernel<E>, dim3(unsigned(T)), dim3(256), 0, m_.stream, static_cast<const E*>(m_.embed.p),
       int(m_.c->hidden_size), d_ids, x_);
}

void Prefill::embed_rows(const int* d_ids, int T) {
  const int H = int(m_.c->hidden_size);
  cudaStream_t st = m_.stream;
  switch (m_.embed.dt) {
    case DT_GGUF: gembed_rows_kernel<<<T, 256, 0, st>>>(m_.embed.p, m_.embed.g, H, d_ids, x_); break;
    case DT_F32: embed_rows_as<float>(d_ids, T); break;
    case DT_F16: embed_rows_as<__half>(d_ids, T); break;
    default: embed_rows_as<__nv_bfloat16>(d_ids, T);
  }
}

void Prefill::norm_rows(const float* x, const float* w, int T, float* y) {
  send(norm_rows_kernel, dim3(T), dim3(row_threads(T)), 0, m_.stream, x, w, int(m_.c->hidden_size),
       m_.c->rms_norm_eps, y, static_cast<__nv_bfloat16*>(nullptr), static_cast<__nv_bfloat16*>(nullptr));
}

void Prefill::norm_split_rows(const float* x, const float* w, int T) {
  send(norm_rows_kernel, dim3(T), dim3(row_threads(T)), 0, m_.stream, x, w, int(m_.c->hidden_size),
       m_.c->rms_norm_eps, xn_, xhi_, xlo_);
}

bool Prefill::skinny_fits(const DMat& W, const float* A, int T) {
  return W.dt == DT_BF16 && T <= kSkinnyMaxRows && W.cols % 8 == 0 && reinterpret_cast<uintptr_t>(A) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(W.p) % 16 == 0 && skinny_weights_fit(W.rows, W.cols);
}

bool Prefill::skinny(const DMat& W, const float* A, int T, int mode) const {
  if (!skinny_fits(W, A, T)) return false;
  // Measured on the H200 (35B synthetic, bench/NOTES-cuda.md, batch-fixed):
  // skinny_gemm_kernel's cost grows with the rows (it re-reads and splits
  // the activations per 32 weight rows), the tiled product's does not
  // until its tiles fill. Up to 16 rows it won everywhere (B = 8: 614 ->
  // 796 tokens/s); at 32 only on matrices whose 128-row tiles leave most
  // SMs idle (out-proj 2.13 -> 1.26 ms, router, shared expert), while the
  // in-proj (97 tiles) took 1.73 -> 2.08 ms; at 64 rows it lost. With 2
  // warp groups along K (session 7) the in-proj at 32 rows won too
  // (B = 32 1,704.5 -> 1,725.4 tokens/s), so every product of up to 32 rows
  // goes through it.
  (void)mode;
  return T <= 32;
}

void Prefill::skinny_gemm(const GemmArgs& a, cudaStream_t s) {
  check(launch_skinny_gemm(a, sms_, s ? s : m_.stream, 1, 0, pdl()), "batched product of few rows");
}

// Dense product: C[T][..] (=, +=, swiglu) = A[T][K] . W^T. A few rows of
// bf16 weights: skinny_gemm_kernel (bound by the weights' bytes); else in
// the tallest tiles that still fill the GPU with blocks. sp: A already
// split (both products read it); else the skinny product splits in
// registers and the pipelined one splits here. out: swiglu's C also split.
void Prefill::dense_rows(const DMat& W, const float* A, int T, float* C, int ldc, int mode, int half, SplitRows sp,
                         bool side, SplitOut out) {
  cudaStream_t s = side ? side_ : m_.stream;
  GemmArgs g;
  g.A = A;
  g.lda = W.cols;
  g.W = W.p;
  g.M = T;
  g.N = W.rows;
  g.K = W.cols;
  g.C = C;
  g.ldc = ldc;
  g.mode = mode;
  g.half = half;
  g.Chi = out.hi, g.Clo = out.lo;
  if (skinny(W, A, T, mode)) {
    g.Ahi = sp.hi, g.Alo = sp.lo;
    skinny_gemm(g, s);
    return;
  }
  if (pipe(W.dt) && !sp.hi) sp = split(A, T, W.cols, side);
  const int bn = pipe(W.dt) ? kPipeBN : kGemmBN;
  const int nt = mode == GEMM_SWIGLU ? div_up(W.rows / 2, bn / 2) : div_up(W.rows, bn);
  int bm = 16;
  for (int b : {64, 32})
    if (b <= tile_rows(T) && int64_t(nt) * div_up(T, b) >= sms_) {
      bm = b;
      break;
    }
  g.gm = W.g;
  if (W.dt == DT_FP8) {  // one part: the codes, then per-row block scales (F8W with 1-row blocks)
    g.qsplit = W.rows;
    g.qgroup = W.group;
    g.qbrows = 1;
    g.qs[0] = W.scale_offset();
  }
  gemm(W.dt, g, bm, div_up(T, bm), sp, s);
}

// The feed-forward of layer l over the T rows of x_ (each row a token of
// its own: the routing and the experts do not look across rows).
bool Prefill::few_rows_experts(int T, int edt) const {
  const ModelConfig& c = *m_.c;
  const int H = int(c.hidden_size), I = int(c.moe_intermediate);
  if (!few_rows_supported(edt, H, max_smem_) || !few_rows_supported(edt, I, max_smem_)) return false;
  if (expert_path_ != 0) return expert_path_ == 2;
  // Rows per expert, T * k spread over E: few_rows_kernel reads each picked
  // expert once per tile of kFewRows rows; the tiled product once per 16 to
  // 64 rows but on the tensor cores. Measured on the H200 (35B synthetic,
  // bench/NOTES-cuda.md, batch-step): few_rows_kernel faster at T * k / E =
  // 0.25 (B = 8: 592 vs 558 tokens/s), slower from 1 (B = 32: 1,237 vs
  // 1,364) up; the crossover between them was not measured.
  constexpr double kFewRowsMean = 0.25;
  return double(T) * double(c.num_experts_per_tok) <= kFewRowsMean * double(std::max<int64_t>(1, c.num_experts));
}

bool Prefill::skinny_experts(int T, int edt) const {
  const ModelConfig& c = *m_.c;
  if (edt != DT_BF16 || c.hidden_size % 8 != 0 || c.moe_intermediate % 8 != 0) return false;
  if (expert_path_ != 0) return expert_path_ == 3;
  // Up to kSkinnyExpertMean rows per picked expert on average (B <= 64 on
  // the 35B). With its weights staged through shared memory (session 20)
  // the skinny product beat the tiled one at B = 32 (1,989-1,991 vs
  // 1,963-1,964 tokens/s) and B = 64 (2,639-2,640 vs 2,576-2,584); before
  // that it won only up to B = 8 (760.6 vs 687.0; few_rows_kernel 735.5).
  // Past B = 64 (more than 2 rows an expert on average) it was not measured.
  return double(T) * double(c.num_experts_per_tok) <=
         kSkinnyExpertMean * double(std::max<int64_t>(1, c.num_experts));
}

bool Prefill::feed_forward(const LayerPlan& l, const DLayer& d, int T, const float* next_norm) {
  const ModelConfig& c = *m_.c;
  cudaStream_t st = m_.stream;
  const int H = int(c.hidden_size);
  const int k = int(c.num_experts_per_tok), E = int(c.num_experts), I = int(c.moe_intermediate);
  auto dense = [&](const DMat& W, const float* A, float* C, int ldc, int mode, int half = 0, SplitRows sp = {},
                   SplitOut out = {}) { dense_rows(W, A, T, C, ldc, mode, half, sp, false, out); };
  norm_split_rows(x_, d.post_norm, T);
  const SplitRows fs{xhi_, xlo_};
  mark(P_NORM);
  // The shared expert reads only xn_ (and its split): on side_ from here,
  // beside the router and the routed experts, joined before the combine.
  // Not under the profile (its phases are timed on the one stream).
  // Measured against the one stream in session 7 (B = 8 883.7 -> 943.3,
  // B = 32 1,638.5 -> 1,704.5 tokens/s; bench/NOTES-cuda.md, batch-more).
  const bool beside = l.ffn != FfnKind::DenseSwiGLU && d.has_shared && !profile_;
  if (beside) {
    CK(cudaEventRecord(fork_, st));
    CK(cudaStreamWaitEvent(side_, fork_, 0));
    // gate/up leaves down's activations split too (on the side's own pair).
    const SplitOut hsp{shi_, slo_};
    dense_rows(d.s_gu, xn_, T, hs_, d.s_down.cols, GEMM_SWIGLU, d.s_down.cols, fs, true, hsp);
    dense_rows(d.s_down, hs_, T, ysh_, H, GEMM_STORE, 0, hsp, true);
    CK(cudaEventRecord(join_, side_));
  }
  // The shared expert in line (below the routed experts, which are done
  // with yhi_ then): gate/up leaves down's activations split in yhi_.
  const SplitOut hsp{yhi_, ylo_};
  if (l.ffn == FfnKind::DenseSwiGLU) {
    dense(d.s_gu, xn_, hs_, d.s_down.cols, GEMM_SWIGLU, d.s_down.cols, fs, hsp);
    dense(d.s_down, hs_, x_, H, GEMM_ADD, 0, hsp);
    mark(P_SHARED);
    return false;
  }
  if (m_.moe_before) m_.moe_before(x_, T);
  dense(d.router, xn_, rl_, d.router.rows, GEMM_STORE, 0, fs);
  mark(P_ROUTER);
  send(topk_rows_kernel, dim3(T), dim3(32), 0, st, rl_, d.router.rows, E, k, c.norm_topk_prob ? 1 : 0,
       d.has_shared ? 1 : 0, ids_, w_, d.tc);
  if (m_.experts_needed) m_.experts_needed(l.moe_slot, ids_, T * k);
  const int edt = d.gg.n ? DT_GGUF : d.q.fp8 ? DT_FP8 : d.q.bits == 8 ? DT_Q8 : d.q.bits == 4 ? DT_Q4 : d.edt;
  const bool skinny = skinny_experts(T, edt), few = !skinny && few_rows_experts(T, edt);
  const int ebm = skinny ? kSkinnyExpertRows : few ? kFewRows : tile_rows(double(T) * k / std::max(E, 1));
  send(route_lists_kernel, dim3(1), dim3(512), 0, st, ids_, T, k, E, ebm, tok_, dest_, tiles_, ntiles_, tile_done_,
       tiles_max_);
  mark(P_ROUTE);
  const int ntiles = std::min(tiles_max_, div_up(int64_t(T) * k, ebm) + E);
  const void* const* gu_tab = d.gu_tab;
  const void* const* down_tab = d.down_tab;
  if (m_.stage_experts) {
    const auto staged = m_.stage_experts(l.moe_slot, T);
    if (staged.first) gu_tab = staged.first, down_tab = staged.second;
  }
  // The routed experts over the tile lists, for the skinny and the tiled
  // products: gate/up (swiglu into hb_) from the normed rows, then down
  // from hb_ into each (token, slot)'s row of y_.
  auto gate_up_args = [&] {
    GemmArgs g;
    g.A = xn_;
    g.lda = H;
    g.arow = tok_;
    g.wtab = gu_tab;
    g.tiles = tiles_;
    g.ntiles = ntiles_;
    g.N = 2 * I;
    g.K = H;
    g.C = hb_;
    g.ldc = I;
    g.mode = GEMM_SWIGLU;
    g.half = I;
    return g;
  };
  auto to_down = [&](GemmArgs& g) {
    g.A = hb_;
    g.lda = I;
    g.arow = nullptr;
    g.wtab = down_tab;
    g.N = H;
    g.K = I;
    g.C = y_;
    g.ldc = H;
    g.crow = dest_;
    g.mode = GEMM_STORE;
    g.half = 0;
  };
  if (skinny) {
    GemmArgs g = gate_up_args();
    g.Ahi = xhi_, g.Alo = xlo_, g.Chi = yhi_, g.Clo = ylo_;  // down reads these
    // As the tiled product's below: gate/up counts each tile's finished
    // blocks, and down's blocks load their first weights, then wait for
    // their tile's count, not for the whole of gate/up (the 35B at B = 32:
    // +0.9-1.8%, bench/NOTES-cuda.md, session 20).
    g.tile_done = tile_done_;
    check(launch_skinny_gemm(g, sms_, st, ntiles, ebm, pdl()), "batched step: experts gate/up (skinny)");
    mark(P_EXPERTS_GU);
    const SkinnyGrid gu = skinny_grid(g, sms_, ntiles);
    g.tile_wait = gu.split * gu.blocks;
    to_down(g);
    g.Ahi = g.Chi, g.Alo = g.Clo;
    g.Chi = g.Clo = nullptr;
    check(launch_skinny_gemm(g, sms_, st, ntiles, ebm, pdl()), "batched step: experts down (skinny)");
    mark(P_EXPERTS_DOWN);
  } else if (few) {
    FewRowsArgs f;
    f.A = xn_;
    f.lda = H;
    f.arow = tok_;
    f.wtab = gu_tab;
    f.tiles = tiles_;
    f.ntiles = ntiles_;
    f.K = H;
    f.N = I;
    f.C = hb_;
    f.ldc = I;
    f.swiglu = 1;
    check(launch_few_rows(edt, f, ntiles, st), "batched step: experts gate/up (few rows)");
    mark(P_EXPERTS_GU);
    f.A = hb_;
    f.lda = I;
    f.arow = nullptr;
    f.wtab = down_tab;
    f.K = I;
    f.N = H;
    f.C = y_;
    f.ldc = H;
    f.crow = dest_;
    f.swiglu = 0;
    check(launch_few_rows(edt, f, ntiles, st), "batched step: experts down (few rows)");
    mark(P_EXPERTS_DOWN);
  } else {
    GemmArgs g = gate_up_args();
    // Quantised experts: gate rows then up rows, each with its scales and biases.
    g.gm = d.gg;
    g.qsplit = I;
    g.qgroup = d.q.group;
    g.qbrows = d.q.block_rows;
    g.qw[0] = 0, g.qs[0] = d.q.gate_s, g.qb[0] = d.q.gate_b;
    g.qw[1] = d.q.up_w, g.qs[1] = d.q.up_s, g.qb[1] = d.q.up_b;
    // bf16: gate/up also writes the down product's activations split into
    // hi/lo (no split kernel between them).
    const bool split_here = pipe(edt);
    g.Chi = split_here ? yhi_ : nullptr;
    g.Clo = split_here ? ylo_ : nullptr;
    // gemm_pipe_kernel: gate/up counts each tile's finished blocks, and
    // down's blocks wait for their tile's count, not for the whole of
    // gate/up: under PDL they fill the SMs that gate/up's last partial wave
    // leaves idle (the 35B at B = 32: ~3.25 waves of 396 blocks; +3.7%,
    // bench/NOTES-cuda.md, session 18).
    g.tile_done = split_here ? tile_done_ : nullptr;
    gemm(edt, g, ebm, ntiles, fs);
    mark(P_EXPERTS_GU);
    g.tile_wait = pipe_blocks_x(g);  // gate/up's blocks per tile (g is still gate/up's)
    to_down(g);
    g.qsplit = H;
    g.qw[0] = 0, g.qs[0] = d.q.dn_s, g.qb[0] = d.q.dn_b;
    g.gm = d.gd;
    g.Chi = g.Clo = nullptr;
    gemm(edt, g, ebm, ntiles, split_here ? SplitRows{yhi_, ylo_} : SplitRows{});
    mark(P_EXPERTS_DOWN);
  }
  if (beside) {
    CK(cudaStreamWaitEvent(st, join_, 0));
  } else if (d.has_shared) {
    dense(d.s_gu, xn_, hs_, d.s_down.cols, GEMM_SWIGLU, d.s_down.cols, fs, hsp);
    dense(d.s_down, hs_, ysh_, H, GEMM_STORE, 0, hsp);
    mark(P_SHARED);
  }
  if (m_.moe_after) next_norm = nullptr;  // the norm of the sum over the GPUs, by the next layer
  if (next_norm)
    send(moe_combine_norm_kernel, dim3(T), dim3(row_threads(T)), 0, st, x_, H, y_, d.has_shared ? ysh_ : nullptr, w_, k,
         next_norm, c.rms_norm_eps, xn_, xhi_, xlo_);
  else
    send(moe_combine_kernel, dim3(T), dim3(row_threads(T)), 0, st, x_, H, y_, d.has_shared ? ysh_ : nullptr, w_, k);
  if (m_.moe_after) m_.moe_after(x_, T);
  mark(P_COMBINE);
  check(cudaGetLastError(), "batched prefill: experts");
  return next_norm != nullptr;
}

// snapkv: the last min(T, kSnapObserved) queries of the chunk (q: its rows of q_) into
// the layer's ring, row p % kSnapObserved: at most two contiguous pieces.
void Prefill::observe_queries(float* ring, const float* q, int p0, int T) {
  const int W = int(KvConfig::kSnapObserved);
  const size_t w = size_t(m_.c->num_heads * m_.c->head_dim);
  for (int t = std::max(0, T - W); t < T;) {
    const int r = (p0 + t) % W, len = std::min(T - t, W - r);
    check(cudaMemcpyAsync(ring + size_t(r) * w, q + size_t(t) * w, size_t(len) * w * 4, cudaMemcpyDeviceToDevice,
                          m_.stream),
          "batched prefill: snapkv queries");
    t += len;
  }
}

void Prefill::run(const PrefillState& s, const int* d_ids, int T, int64_t pos) {
  const PromptRows one{s, 0, T, pos};
  run_rows(&one, 1, d_ids);
}

bool Prefill::in_order(const KvLayer& kv, int p0, int T) {
  return (kv.acc && p0 + T > kv.cap) || (kv.quest && p0 + T > kv.quest);
}

void Prefill::run_rows(const PromptRows* seqs, int S, const int* d_ids) {
  const ModelConfig& c = *m_.c;
  cudaStream_t st = m_.stream;
  const int H = int(c.hidden_size);
  int R = 0;
  for (int j = 0; j < S; ++j) {
    if (seqs[j].r0 != R) fail("batched prefill: the sequences' rows are not consecutive");
    R += seqs[j].T;
  }
  if (R < 1 || R > tmax_) fail("batched prefill: " + std::to_string(R) + " rows, outside 1.." + std::to_string(tmax_));
  event_phase_.clear();
  mark(P_OTHER);  // the start
  // Attention in order (an h2o cache that evicts in this chunk, a Quest
  // store past its budget): the positions of its tokens for
  // attend_in_order's kernels (which take them by pointer, as a decode
  // step). One sequence only: seq_ and the scores scratch are the pass's.
  bool ordered = false;
  for (int j = 0; j < S; ++j)
    if (!seqs[j].s.kvl->empty() && in_order(seqs[j].s.kvl->front(), int(seqs[j].pos), seqs[j].T)) ordered = true;
  if (ordered && S > 1) fail("batched prefill: attention in order for one of several sequences");
  if (ordered) fill_seq_kernel<<<unsigned(div_up(R, 256)), 256, 0, st>>>(seq_, int(seqs[0].pos), R);
  auto dense = [&](const DMat& W, const float* A, float* C, int ldc, int mode, int half = 0, SplitRows sp = {}) {
    dense_rows(W, A, R, C, ldc, mode, half, sp);
  };
  switch (m_.embed.dt) {
    case DT_GGUF: gembed_rows_kernel<<<R, 256, 0, st>>>(m_.embed.p, m_.embed.g, H, d_ids, x_); break;
    case DT_F32: embed_rows_kernel<<<R, 256, 0, st>>>(static_cast<const float*>(m_.embed.p), H, d_ids, x_); break;
    case DT_F16: embed_rows_kernel<<<R, 256, 0, st>>>(static_cast<const __half*>(m_.embed.p), H, d_ids, x_); break;
    default:
      embed_rows_kernel<<<R, 256, 0, st>>>(static_cast<const __nv_bfloat16*>(m_.embed.p), H, d_ids, x_);
  }
  mark(P_OTHER);
  const int nv = int(c.lin_num_v_heads), dk = int(c.lin_k_dim), dv = int(c.lin_v_dim);
  const int C = int(c.lin_conv_dim()), K = int(c.conv_kernel);
  const size_t qw = size_t(c.num_heads * c.head_dim);  // q_ / attention's o_ row
  const PassSeqs pass = upload_pass(seqs, S, R);
  for (const LayerPlan& l : m_.plan->layers) {
    const DLayer& d = (*m_.L)[size_t(l.index)];
    const int sl = l.state_slot;
    const bool attention = l.mixer == MixerKind::GatedAttention;
    norm_split_rows(x_, d.in_norm, R);
    const SplitRows xs{xhi_, xlo_};
    mark(P_NORM);
    if (!attention) {  // GatedDeltaNet: the products over every row, each sequence's recurrence (one launch for all)
      dense(d.lin_in, xn_, proj_, proj_stride_, GEMM_STORE, 0, xs);
      mark(P_INPROJ);
      PassSeqs ps = pass;
      ps.conv = pass_conv_ + size_t(sl) * S;
      ps.ssm = pass_ssm_ + size_t(sl) * S;
      conv_rows_kernel<<<dim3(unsigned(div_up(C, 128)), unsigned(R)), 128, 0, st>>>(proj_, proj_stride_, C, K,
                                                                                  d.conv_w, ps, cv_);
      conv_state_kernel<<<dim3(unsigned(div_up(C, 128)), unsigned(S)), 128, 0, st>>>(proj_, proj_stride_, C, K, ps);
      mark(P_CONV);
      DeltaRowsArgs a;
      fill_delta_layer(a, c, d);
      a.conv = cv_;
      a.C = C;
      a.proj = proj_;
      a.pstride = proj_stride_;
      a.beta = beta_;
      a.decay = decay_;
      a.out = o_;
      delta_rows_kernel<<<R, 256, 0, st>>>(a);
      mark(P_DELTA_PRE);
      const dim3 g{unsigned(nv), unsigned(dv / 32), unsigned(S)};
      switch (dk) {
        case 32: delta_scan_kernel<32><<<g, 128, 0, st>>>(a, ps); break;
        case 64: delta_scan_kernel<64><<<g, 256, 0, st>>>(a, ps); break;
        case 128: delta_scan_kernel<128><<<g, 512, 0, st>>>(a, ps); break;
        default: delta_scan_kernel<256><<<g, 1024, 0, st>>>(a, ps); break;
      }
      mark(P_DELTA_SCAN);
      gated_norm_rows_kernel<<<dim3(unsigned(R), unsigned(nv)), unsigned(div_up(dv, 32) * 32), 0, st>>>(a);
      mark(P_GATED_NORM);
      dense(d.out_proj, o_, x_, H, GEMM_ADD);
      mark(P_OUTPROJ);
    } else {
      dense(d.qkv, xn_, proj_, proj_stride_, GEMM_STORE, 0, xs);
      mark(P_INPROJ);
      for (int j = 0; j < S; ++j) {
        const PrefillState& s = seqs[j].s;
        const int T = seqs[j].T, p0 = int(seqs[j].pos);
        const KvLayer& kv = (*s.kvl)[size_t(sl)];
        // h2o evicting: each token's victim depends on the scores of the
        // attention of every token before it, so attention goes token by
        // token (the decode step's kernels); the rest of the layer stays batched.
        if (ordered) attend_in_order(s, d, kv, T);
        else attend_chunk(s, d, kv, p0, T, seqs[j].r0);
        if (s.snap_q) observe_queries(s.snap_q[sl], q_ + size_t(seqs[j].r0) * qw, p0, T);
      }
      dense(d.o_proj, o_, x_, H, GEMM_ADD);
      mark(P_OUTPROJ);
    }
    check(cudaGetLastError(), attention ? "batched prefill: attention" : "batched prefill: linear attention");
    feed_forward(l, d, R);
  }
  for (int j = 0; j < S; ++j)
    set_int_kernel<<<1, 1, 0, st>>>(seqs[j].s.d_pos, int(seqs[j].pos) + seqs[j].T);
  check(cudaGetLastError(), "batched prefill");
  if (!profile_) return;
  collect(phase_ms_);
  ++chunks_;
  tokens_ += R;
}

void Prefill::gather_rows(const int* rows, int n) {
  const size_t H = size_t(m_.c->hidden_size);
  for (int i = 0; i < n; ++i) {
    if (rows[i] < i || (i > 0 && rows[i] <= rows[i - 1])) fail("batched prefill: gather_rows needs rising rows");
    if (rows[i] == i) continue;
    check(cudaMemcpyAsync(x_ + size_t(i) * H, x_ + size_t(rows[i]) * H, H * 4, cudaMemcpyDeviceToDevice, m_.stream),
          "batched prefill: gather rows");
  }
}

GemmArgs Prefill::lm_head_args(int rows) const {
  GemmArgs g;
  g.A = xn_;
  g.lda = int(m_.c->hidden_size);
  g.W = m_.lm_head.p;
  g.gm = m_.lm_head.g;
  g.M = rows;
  g.N = m_.lm_head.rows;
  g.K = int(m_.c->hidden_size);
  g.C = logits_;
  g.ldc = int(m_.c->vocab_size);
  return g;
}

void Prefill::logits(int t0, int n, float* dst) {
  const ModelConfig& c = *m_.c;
  const int H = int(c.hidden_size);
  const size_t V = size_t(c.vocab_size);
  for (int b = 0; b < n; b += lrows_) {
    const int rows = std::min(lrows_, n - b);
    norm_rows_kernel<<<rows, 256, 0, m_.stream>>>(x_ + size_t(t0 + b) * H, m_.final_norm, H, c.rms_norm_eps, xn_,
                                                  nullptr, nullptr);
    const int bm = tile_rows(rows);
    gemm(m_.lm_head.dt, lm_head_args(rows), bm, div_up(rows, bm));
    CK(cudaMemcpyAsync(dst + size_t(b) * V, logits_, size_t(rows) * V * 4, cudaMemcpyDeviceToHost, m_.stream));
    CK(cudaStreamSynchronize(m_.stream));
  }
}

}  // namespace flashmoe::cuda
