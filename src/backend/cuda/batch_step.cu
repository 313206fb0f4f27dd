// One decode step over a batch of independent sequences (Prefill::step_batch,
// prefill.cuh): the batched prefill's row-wise products and grouped experts
// over the B tokens, the per-sequence steps (conv1d, delta rule, attention)
// through batch_kernels.cuh with each sequence's own state.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "backend/cuda/batch_kernels.cuh"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/prefill.cuh"
#include "core/error.h"

namespace flashmoe::cuda {

namespace {

int div_up(int64_t a, int64_t b) { return int((a + b - 1) / b); }

// A launch in clusters of `cluster` blocks along x, with programmatic
// dependent launch where pdl (Prefill::pdl(); the kernels wait in pdl_wait()).
template <typename... K, typename... A>
void launch(cudaStream_t st, bool pdl, void (*kern)(K...), dim3 grid, int block, size_t smem, int cluster,
            A... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(block));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute at[2];
  int n = 0;
  if (cluster > 1) {
    at[n].id = cudaLaunchAttributeClusterDimension;
    at[n++].val.clusterDim = {unsigned(cluster), 1, 1};
  }
  if (pdl) {
    at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cfg.attrs = at;
  cfg.numAttrs = n;
  check(cudaLaunchKernelEx(&cfg, kern, args...), "batched decode step");
}

// Bump allocator over the step's argument blob (16-byte aligned pieces).
struct Blob {
  size_t n = 0;
  template <typename T>
  size_t take(size_t count) {
    const size_t at = (n + 15) / 16 * 16;
    n = at + count * sizeof(T);
    return at;
  }
};

}  // namespace

void* Prefill::batch_args(size_t bytes) {
  if (bytes > args_n_) {
    CK(cudaStreamSynchronize(m_.stream));  // nothing in flight reads the old ones
    drop_batch_graphs();  // they read the old device buffer
    cudaFree(args_dev_);
    cudaFreeHost(args_host_);
    args_dev_ = args_host_ = nullptr;
    args_n_ = 0;
    const size_t n = std::max<size_t>(bytes * 2, 64 * 1024);
    args_dev_ = dev_alloc(n, "the batched decode step's arguments");
    CK(cudaMallocHost(&args_host_, n));
    args_n_ = n;
  }
  return args_host_;
}

void Prefill::drop_batch_graphs() {
  for (auto& [key, g] : batch_graphs_) cudaGraphExecDestroy(g);
  batch_graphs_.clear();
}

void Prefill::step_batch(const PrefillState* seqs, int B, const int32_t* ids, const VerifyRows* verify) {
  const ModelConfig& c = *m_.c;
  cudaStream_t st = m_.stream;
  const int H = int(c.hidden_size);
  const int nv = int(c.lin_num_v_heads), dk = int(c.lin_k_dim), dv = int(c.lin_v_dim);
  const int C = int(c.lin_conv_dim()), K = int(c.conv_kernel);
  const int nh = int(c.num_heads), nkv = int(c.num_kv_heads), hd = int(c.head_dim);
  int nlin = 0, nattn = 0;
  for (const LayerPlan& l : m_.plan->layers) ++(l.mixer == MixerKind::GatedAttention ? nattn : nlin);
  // A verify pass: every row is a token of seqs[0].
  auto seq = [&](int b) -> const PrefillState& { return seqs[verify ? 0 : b]; };
  const bool cluster = dv % 32 == 0 && dv / 32 <= 8 && (dk == 128 || dk == 64 || dk == 32);
  if (verify && (!cluster || (!seqs[0].kvl->empty() && ((*seqs[0].kvl)[0].acc || (*seqs[0].kvl)[0].window))))
    fail("batched step: a verify pass of this model or KV cache (CudaModel::verify_fits)");
  const size_t conv_n = size_t(C) * size_t(K - 1), ssm_n = size_t(nv) * dk * dv;  // floats of one state
  // Attention's kernels are instances per KV storage type: the sequences
  // in order of it (their rows stay in the caller's order).
  std::vector<int> order(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) order[size_t(b)] = b;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return seq(a).kvt < seq(b).kvt; });
  std::vector<int> h2o;  // the sequences with scored eviction (h2o, tova)
  for (int b = 0; b < B; ++b)
    if (!seq(b).kvl->empty() && (*seq(b).kvl)[0].acc) h2o.push_back(b);
  const int nh2o = int(h2o.size());

  Blob blob;
  const size_t o_ids = blob.take<int>(size_t(B)), o_pos = blob.take<int*>(size_t(B));
  const size_t o_conv = blob.take<float*>(size_t(nlin) * B), o_delta = blob.take<DeltaArgs>(size_t(nlin) * B);
  const size_t o_prep = blob.take<AttnPrepArgs>(size_t(nattn) * B), o_attn = blob.take<AttnArgs>(size_t(nattn) * B);
  const size_t o_h2o = blob.take<H2oAccArgs>(size_t(nattn) * nh2o);
  // A verify pass: the rows' positions, and the sequence's (the graph reads it from here).
  const size_t o_rowpos = blob.take<int>(size_t(B)), o_seqpos = blob.take<int*>(1);
  char* hb = static_cast<char*>(batch_args(blob.n));
  char* db = static_cast<char*>(args_dev_);
  auto host = [&](size_t off) { return hb + off; };
  std::memcpy(host(o_ids), ids, size_t(B) * 4);
  int** pos = reinterpret_cast<int**>(host(o_pos));
  int* rowpos = reinterpret_cast<int*>(host(o_rowpos));
  int* d_rowpos = reinterpret_cast<int*>(db + o_rowpos);
  *reinterpret_cast<int**>(host(o_seqpos)) = seqs[0].d_pos;
  for (int b = 0; b < B; ++b) {
    rowpos[b] = verify ? int(verify->p0) + b : 0;
    pos[b] = verify ? d_rowpos + b : seqs[b].d_pos;
  }
  // Where the recurrent states after row b go: a verify pass keeps every
  // row's (the last row's in the sequence's own state, as a step's).
  auto kept = [&](const std::vector<float*>* rows, const std::vector<float*>* own, size_t sl, int b, size_t n) {
    return verify && b + 1 < B ? (*rows)[sl] + size_t(b) * n : (*own)[sl];
  };
  float** convs = reinterpret_cast<float**>(host(o_conv));
  DeltaArgs* deltas = reinterpret_cast<DeltaArgs*>(host(o_delta));
  AttnPrepArgs* preps = reinterpret_cast<AttnPrepArgs*>(host(o_prep));
  AttnArgs* attns = reinterpret_cast<AttnArgs*>(host(o_attn));
  H2oAccArgs* h2os = reinterpret_cast<H2oAccArgs*>(host(o_h2o));
  for (const LayerPlan& l : m_.plan->layers) {
    const DLayer& d = (*m_.L)[size_t(l.index)];
    const size_t sl = size_t(l.state_slot);
    if (l.mixer == MixerKind::GatedDeltaNet) {
      for (int b = 0; b < B; ++b) {
        convs[sl * B + b] = kept(verify ? verify->conv_rows : nullptr, seq(b).conv, sl, b, conv_n);
        DeltaArgs& a = deltas[sl * B + b];
        fill_delta_layer(a, c, d);
        a.conv = cv_ + size_t(b) * C;
        a.proj = proj_ + size_t(b) * proj_stride_;
        a.S = kept(verify ? verify->ssm_rows : nullptr, seq(b).ssm, sl, b, ssm_n);
        a.out = o_ + size_t(b) * nv * dv;
      }
      continue;
    }
    for (int j = 0; j < B; ++j) {
      const int b = order[size_t(j)];
      const PrefillState& s = seq(b);
      const KvLayer& kv = (*s.kvl)[sl];
      preps[sl * B + j] = attn_prep_args(c, d, proj_ + size_t(b) * proj_stride_, q_ + size_t(b) * nh * hd, pos[b],
                                         m_.inv_freq, kv, s.ns, s.kvt);
      // One block per head until the groups below set the split.
      attns[sl * B + j] = attn_args(c, q_ + size_t(b) * nh * hd, proj_ + size_t(b) * proj_stride_,
                                    verify ? verify->scores + size_t(b) * verify->scores_row : s.scores,
                                    o_ + size_t(b) * nh * hd, pos[b], kv, s.ns);
    }
    for (int j = 0; j < nh2o; ++j) {
      const PrefillState& s = seq(h2o[size_t(j)]);
      h2os[sl * nh2o + j] = H2oAccArgs{(*s.kvl)[sl], s.scores, s.d_pos};
    }
  }
  // Groups of one KV storage type: [first, end) in `order`, blocks per head.
  struct Group {
    int kvt, first, end, split;
  };
  std::vector<Group> groups;
  int max_cap = 1;
  for (int j = 0; j < B; ++j) {
    const PrefillState& s = seq(order[size_t(j)]);
    if (groups.empty() || groups.back().kvt != s.kvt) groups.push_back({s.kvt, j, j, 1});
    groups.back().end = j + 1;
    groups.back().split = std::max(groups.back().split, s.attn_split);
    if (!s.kvl->empty()) max_cap = std::max(max_cap, (*s.kvl)[0].cap);
  }
  // A sequence's split (attn_blocks) is sized for one query alone, where
  // its head's blocks are all the step has. Over B sequences the nh * B
  // heads already give the SMs blocks, and each block's fixed chain (wait,
  // q, max, sum, the cluster's combine) over a few positions was most of
  // the attention's cost: each group's split is halved while the step's
  // attention blocks exceed kAttnBlocksPerSm an SM. The 35B at 128
  // positions: B = 32 split 8 -> 2 (4,096 -> 1,024 blocks) +0.9-1.8% a
  // step, B = 64 8 -> 1 +2.5-2.8%, B <= 8 unchanged; at 2,048 positions
  // B = 32 +2.6%. 4 an SM (B = 32 at split 1) gave +2.2% at 128 positions
  // but B = 8 at 2,048 -1% (bench/NOTES-cuda.md, session 22).
  constexpr int kAttnBlocksPerSm = 8;
  for (Group& g : groups)
    while (g.split > 1 && int64_t(nh) * B * g.split > int64_t(kAttnBlocksPerSm) * sms_) g.split /= 2;
  for (int a = 0; a < nattn; ++a)
    for (const Group& g : groups)
      for (int j = g.first; j < g.end; ++j) attns[size_t(a) * B + j].split = g.split;
  CK(cudaMemcpyAsync(db, hb, blob.n, cudaMemcpyHostToDevice, st));
  auto dev = [&](size_t off) { return db + off; };
  const int* d_ids = reinterpret_cast<const int*>(dev(o_ids));

  event_phase_.clear();
  mark(P_OTHER);  // the start
  auto enqueue = [&] {
    stepping_ = true;  // launches with PDL (pdl())
    embed_rows(d_ids, B);
    mark(P_OTHER);
    const int groups_att = std::max(8, 256 / std::max(hd, 1));  // attn_kernel's partials, as the decode step
    const size_t attn_smem = size_t(2 * hd + groups_att * hd) * 4;
    const size_t prep_smem = size_t(std::max(hd, 2 * nkv * hd)) * 4;
    const std::vector<LayerPlan>& layers = m_.plan->layers;
    bool normed = false;  // xn_ holds this layer's normed input (the combine before did it)
    for (size_t li = 0; li < layers.size(); ++li) {
      const LayerPlan& l = layers[li];
      const DLayer& d = (*m_.L)[size_t(l.index)];
      const size_t sl = size_t(l.state_slot);
      // The input projection's activations also as hi/lo bf16 rows, which
      // the norm leaves (or the combine before, which normed them).
      if (!normed) norm_split_rows(x_, d.in_norm, B);
      const SplitRows xs{xhi_, xlo_};
      mark(P_NORM);
      if (l.mixer == MixerKind::GatedDeltaNet) {
        dense_rows(d.lin_in, xn_, B, proj_, proj_stride_, GEMM_STORE, 0, xs);
        mark(P_INPROJ);
        float* const* convs_dev = reinterpret_cast<float* const*>(dev(o_conv + sl * B * sizeof(float*)));
        if (verify)
          launch(st, pdl(), conv_verify_kernel, dim3(unsigned(div_up(C, 256))), 256, 0, 1,
                 static_cast<const float*>(proj_), proj_stride_, C, K, static_cast<const float*>(d.conv_w), convs_dev,
                 cv_, B);
        else
          launch(st, pdl(), conv_batch_kernel, dim3(unsigned(div_up(C, 256)), unsigned(B)), 256, 0, 1,
                 static_cast<const float*>(proj_), proj_stride_, C, K, static_cast<const float*>(d.conv_w), convs_dev,
                 cv_);
        mark(P_CONV);
        const DeltaArgs* da = reinterpret_cast<const DeltaArgs*>(dev(o_delta + sl * B * sizeof(DeltaArgs)));
        // Verify rows (one sequence): one cluster per head walks the rows.
        // Else each head's state staged through shared memory where it fits
        // (delta_staged.cuh: measured faster than the decode step's cluster
        // kernel in session 8's H200 rounds); heads it does not take (dv over
        // 128, dk 256) as the decode step: a cluster of blocks per head (32
        // value columns each) where the shapes allow, else one block per head.
        if (verify) {
          const int cl = dv / 32;
          const dim3 g(unsigned(nv * cl));
          if (dk == 128) launch(st, pdl(), delta_cluster_verify_kernel<128, 32, 8>, g, 256, 0, cl, da, B);
          else if (dk == 64) launch(st, pdl(), delta_cluster_verify_kernel<64, 32, 8>, g, 256, 0, cl, da, B);
          else launch(st, pdl(), delta_cluster_verify_kernel<32, 32, 8>, g, 256, 0, cl, da, B);
        } else if (delta_staged_fits(dk, dv, max_smem_)) {
          const size_t smem = delta_staged_smem(dk, dv);
          auto go = [&](auto kern) {
            check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                  "batched decode step: the delta rule's shared memory");
            launch(st, pdl(), kern, dim3(unsigned(nv), unsigned(B)), dv * kStagedThreads, smem, 1, da);
          };
          if (dk == 128) go(delta_staged_batch_kernel<128>);
          else if (dk == 64) go(delta_staged_batch_kernel<64>);
          else go(delta_staged_batch_kernel<32>);
        } else if (cluster) {
          const int cl = dv / 32;
          const dim3 g(unsigned(nv * cl), unsigned(B));
          if (dk == 128) launch(st, pdl(), delta_cluster_batch_kernel<128, 32, 8>, g, 256, 0, cl, da);
          else if (dk == 64) launch(st, pdl(), delta_cluster_batch_kernel<64, 32, 8>, g, 256, 0, cl, da);
          else launch(st, pdl(), delta_cluster_batch_kernel<32, 32, 8>, g, 256, 0, cl, da);
        } else {
          const size_t smem = size_t(2 * dk) * 4;
          auto th = [&](int split) { return std::min(1024, std::max(32, (dv * split + 31) / 32 * 32)); };
          void (*kern)(const DeltaArgs*) = delta_batch_kernel<0, 1>;
          int threads = th(1);
          if (dk == 128 && dv * 4 <= 1024) kern = delta_batch_kernel<128, 4>, threads = th(4);
          else if (dk == 64 && dv * 2 <= 1024) kern = delta_batch_kernel<64, 2>, threads = th(2);
          else if (dk == 32) kern = delta_batch_kernel<32, 1>;
          launch(st, pdl(), kern, dim3(unsigned(nv), unsigned(B)), threads, smem, 1, da);
        }
        mark(P_DELTA_SCAN);
        dense_rows(d.out_proj, o_, B, x_, H, GEMM_ADD);
        mark(P_OUTPROJ);
      } else {
        dense_rows(d.qkv, xn_, B, proj_, proj_stride_, GEMM_STORE, 0, xs);
        mark(P_INPROJ);
        launch(st, pdl(), attn_prep_batch_kernel, dim3(unsigned(nh + 1), unsigned(B)), 128, prep_smem, 1,
               reinterpret_cast<const AttnPrepArgs*>(dev(o_prep + sl * B * sizeof(AttnPrepArgs))));
        mark(P_ATTN_PREP);
        for (const Group& g : groups) {
          const AttnArgs* aa = reinterpret_cast<const AttnArgs*>(dev(o_attn + (sl * B + g.first) * sizeof(AttnArgs)));
          const dim3 grid(unsigned(nh * g.split), unsigned(g.end - g.first));
          switch (g.kvt) {
            case KV_F32: launch(st, pdl(), attn_batch_kernel<KV_F32>, grid, 256, attn_smem, g.split, aa); break;
            case KV_BF16: launch(st, pdl(), attn_batch_kernel<KV_BF16>, grid, 256, attn_smem, g.split, aa); break;
            case KV_F16: launch(st, pdl(), attn_batch_kernel<KV_F16>, grid, 256, attn_smem, g.split, aa); break;
            default: launch(st, pdl(), attn_batch_kernel<KV_FP8>, grid, 256, attn_smem, g.split, aa); break;
          }
        }
        if (nh2o)
          launch(st, pdl(), h2o_acc_batch_kernel, dim3(unsigned(div_up(max_cap, 128)), unsigned(nh2o)), 128, 0, 1,
                 reinterpret_cast<const H2oAccArgs*>(dev(o_h2o + sl * nh2o * sizeof(H2oAccArgs))), nh);
        mark(P_ATTN);
        dense_rows(d.o_proj, o_, B, x_, H, GEMM_ADD);
        mark(P_OUTPROJ);
      }
      check(cudaGetLastError(), "batched decode step: mixer");
      const float* next_norm = li + 1 < layers.size() ? (*m_.L)[size_t(layers[li + 1].index)].in_norm : nullptr;
      normed = feed_forward(l, d, B, next_norm);
    }
    if (verify)
      send(verify_position_kernel, dim3(1), dim3(1), 0, st, reinterpret_cast<int* const*>(dev(o_seqpos)),
           static_cast<const int*>(d_rowpos), B);
    else
      send(advance_positions_kernel, dim3(unsigned(div_up(B, 128))), dim3(128), 0, st,
           reinterpret_cast<int* const*>(dev(o_pos)), B);
    check(cudaGetLastError(), "batched decode step");
    mark(P_OTHER);
    stepping_ = false;
  };
  // A graph reads every per-sequence value from the arguments copied above,
  // so one serves every batch of the same shape. Not with the disk tier
  // (the host reads the routing between kernels) or the profile; a verify
  // pass always (it stands in for a graph-captured decode step).
  if ((!batch_graph_ && !verify) || m_.experts_needed || profile_) {
    enqueue();
    if (profile_) {
      collect(step_ms_);
      ++steps_;
      step_tokens_ += B;
    }
    return;
  }
  std::string key = (verify ? "v" : "") + std::to_string(B) + "/" + std::to_string(nh2o) + "/" + std::to_string(div_up(max_cap, 128));
  for (const Group& g : groups)
    key += "/" + std::to_string(g.kvt) + ":" + std::to_string(g.end - g.first) + ":" + std::to_string(g.split);
  auto it = batch_graphs_.find(key);
  if (it == batch_graphs_.end()) {
    // A shape's first step runs as plain launches and its second is
    // captured: a capture costs about a fifth of a 32-row step in host time
    // with the device idle, and in a server most shapes (a sequence joining
    // or leaving, the longest KV crossing 128 positions) come back, but some
    // never do.
    if (batch_shapes_seen_.size() >= 1024) batch_shapes_seen_.clear();
    if (batch_shapes_seen_.insert(key).second) {
      enqueue();
      return;
    }
    if (batch_graphs_.size() >= 64) drop_batch_graphs();  // bounded: shapes seen recently are rebuilt
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(st, &graph);
      cudaGetLastError();
      throw;
    }
    CK(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    check(e, "batched decode step: cudaGraphInstantiate");
    it = batch_graphs_.emplace(key, exec).first;
  }
  CK(cudaGraphLaunch(it->second, st));
}

void Prefill::logits_rows(int n, float* const* dst, int32_t* const* best) {
  const ModelConfig& c = *m_.c;
  const int H = int(c.hidden_size);
  const size_t V = size_t(c.vocab_size);
  for (int b = 0; b < n; b += lrows_) {
    const int rows = std::min(lrows_, n - b);
    int first = rows, end = 0;  // the rows whose logits go to the host
    bool ids = false;
    for (int r = 0; r < rows; ++r) {
      if (dst[b + r]) first = std::min(first, r), end = r + 1;
      ids = ids || best[b + r];
    }
    if (first == rows && !ids) continue;
    const bool sk = skinny_fits(m_.lm_head, xn_, rows);
    if (sk) norm_split_rows(x_ + size_t(b) * H, m_.final_norm, rows);
    else norm_rows(x_ + size_t(b) * H, m_.final_norm, rows, xn_);
    GemmArgs g = lm_head_args(rows);
    if (sk) {  // measured: 0.76 -> 0.52 ms at 32 rows on the 35B's lm_head
      g.Ahi = xhi_, g.Alo = xlo_;
      skinny_gemm(g);
    } else {
      const int bm = tile_rows(rows);
      gemm(m_.lm_head.dt, g, bm, div_up(rows, bm));
    }
    if (ids) {
      if (!best_host_) CK(cudaMallocHost(&best_host_, size_t(lrows_) * sizeof(int)));
      argmax_rows_kernel<<<rows, 1024, 0, m_.stream>>>(logits_, int(V), best_dev_);
      check(cudaGetLastError(), "batched step: argmax");
      CK(cudaMemcpyAsync(best_host_, best_dev_, size_t(rows) * sizeof(int), cudaMemcpyDeviceToHost, m_.stream));
    }
    // One copy of the rows wanted, into pinned memory (a copy per row into
    // the callers' pageable buffers went at a fraction of the link's speed).
    if (first < end) {
      if (!logits_host_) CK(cudaMallocHost(&logits_host_, size_t(lrows_) * V * 4));
      CK(cudaMemcpyAsync(logits_host_ + size_t(first) * V, logits_ + size_t(first) * V, size_t(end - first) * V * 4,
                         cudaMemcpyDeviceToHost, m_.stream));
    }
    CK(cudaStreamSynchronize(m_.stream));
    for (int r = 0; r < rows; ++r) {
      if (dst[b + r]) std::memcpy(dst[b + r], logits_host_ + size_t(r) * V, V * 4);
      if (best[b + r]) *best[b + r] = best_host_[r];
    }
  }
}

}  // namespace flashmoe::cuda
