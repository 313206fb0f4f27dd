// The decode step: one token through every layer, walking the layer plan
// (mixer, then feed-forward), routing decided on the device so that a step
// needs no host round trip (except under the disk tier). Every launch of
// the step's kernels is in this unit (launch.cuh says why).
#include <algorithm>
#include <cmath>
#include <string>

#include <cuda.h>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/delta_cluster.cuh"
#include "backend/cuda/down_early.cuh"
#include "backend/cuda/embed_argmax.cuh"
#include "backend/cuda/gguf_dense_matvec.cuh"
#include "backend/cuda/gguf_chunk_experts.cuh"
#include "backend/cuda/gguf_staged.cuh"
#include "backend/cuda/model_impl.cuh"
#include "backend/cuda/fp8_experts.cuh"
#include "backend/cuda/fp8_gate_up_smem.cuh"
#include "backend/cuda/fp8_router.cuh"
#include "backend/cuda/fp8_rows.cuh"
#include "backend/cuda/quant_experts.cuh"
#include "core/error.h"

namespace flashmoe {

void CudaModel::Impl::set_kernel_attributes() {
  // The opt-in limit covers static shared memory too (the reductions use a little).
  const int big = int(prop.sharedMemPerBlockOptin) - 4096;
  CK(cudaFuncSetAttribute(matvec_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(matvec_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(matvec_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gate_up_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gate_up_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gate_up_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gmatvec_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(ggate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gmatvec_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gdense_matvec_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(ggate_up_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gdown_staged_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gdown_staged_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gdown_staged_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(gdown_staged_kernel<kDownRun>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  gc_allow_smem(big);
  CK(cudaFuncSetAttribute(matvec_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(matvec_fp8_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
}

void CudaModel::Impl::mark(int cls) {
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

void CudaModel::Impl::matvec(const DMat& W, const float* xin, const float* nw, float* y, int acc, int cls, float* xcopy) {
  if (W.dt == DT_GGUF && gmat_dense(W.g) && gdense_smem(W.cols) <= size_t(prop.sharedMemPerBlockOptin) - 4096) {
    const size_t smem = gdense_smem(W.cols);
    const int resident =
        prop.multiProcessorCount * per_sm(reinterpret_cast<const void*>(gdense_matvec_kernel), smem);
    const int split = gdense_split(W.g, W.cols, resident), rpb = kWarps / split;
    const int blocks = std::min((gdense_units(W.g) + rpb - 1) / rpb, resident);
    go(gdense_matvec_kernel, blocks, kThreads, smem, static_cast<const void*>(W.p), W.g, W.cols, split, xin, nw,
       c.rms_norm_eps, y, acc, xcopy);
    mark(cls);
    return;
  }
  if (W.dt == DT_GGUF) {
    // Staged through shared memory (gguf_staged.cuh) where two buffers a warp fit.
    const GStage st = gstage_plan(W.g, W.cols, prop.multiProcessorCount * kBlocksPerSm * kWarps);
    const size_t ssm = gmatvec_staged_smem(st, W.cols);
    if (ssm <= size_t(prop.sharedMemPerBlockOptin) - 4096) {
      int runs = 0;
      for (int i = 0; i < W.g.n; ++i) runs += (W.g.row0[i + 1] - W.g.row0[i] + st.R[i] - 1) / st.R[i];
      const int blocks =
          std::min((runs + kWarps - 1) / kWarps,
                   prop.multiProcessorCount * per_sm(reinterpret_cast<const void*>(gmatvec_staged_kernel), ssm));
      go(gmatvec_staged_kernel, blocks, kThreads, ssm, static_cast<const void*>(W.p), W.g, st, W.cols, xin, nw,
         c.rms_norm_eps, y, acc, xcopy);
      mark(cls);
      return;
    }
    const size_t smem = size_t(W.cols) * 4;
    const int blocks = std::min((W.rows + kWarps - 1) / kWarps,
                                prop.multiProcessorCount * per_sm(reinterpret_cast<const void*>(gmatvec_kernel), smem));
    go(gmatvec_kernel, blocks, kThreads, smem, static_cast<const void*>(W.p), W.g, W.rows, W.cols, xin, nw,
       c.rms_norm_eps, y, acc, xcopy);
    mark(cls);
    return;
  }
  if (W.dt == DT_FP8) {
    matvec_fp8(W, xin, nw, y, acc, cls, xcopy);
    return;
  }
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

// matvec() for a DT_FP8 matrix (fp8_matvec.cuh): the same grid and split
// rules; up to 4 rows per warp at a time (a row is half a bf16 row's bytes).
void CudaModel::Impl::matvec_fp8(const DMat& W, const float* xin, const float* nw, float* y, int acc, int cls,
                                 float* xcopy) {
  // Whole rows per warp (fp8_rows.cuh) where the shape allows it.
  if (const int split = f8_rows_split(W.cols, W.group); split && (reinterpret_cast<uintptr_t>(xin) & 15) == 0) {
    const size_t smem = f8_rows_smem(W.cols);
    const void* fn = reinterpret_cast<const void*>(matvec_fp8_rows_kernel);
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int rpb = kWarps / split, groups = (W.rows + kF8RowsR - 1) / kF8RowsR;
    const int blocks = std::min((groups + rpb - 1) / rpb, prop.multiProcessorCount * per_sm(fn, smem));
    go(matvec_fp8_rows_kernel, blocks, kThreads, smem, static_cast<const uint8_t*>(W.p), W.row_scales(), W.group,
       W.rows, W.cols, xin, nw, c.rms_norm_eps, y, acc, split, xcopy);
    mark(cls);
    return;
  }
  if (W.group % kF8Step == 0) {  // the tensor cores (fp8_mma.cuh), codes staged (fp8_staged.cuh)
    const int split = f8_mma_split(W.rows, W.cols, prop.multiProcessorCount), tpb = kWarps / split;
    const size_t smem = f8_mma_matvec_smem(W.cols, f8_norm_fused(nw, W.cols));
    const int tiles = (W.rows + 15) / 16;
    const int blocks = std::min((tiles + tpb - 1) / tpb,
                                prop.multiProcessorCount *
                                    per_sm(reinterpret_cast<const void*>(matvec_fp8_mma_kernel), smem));
    // The L2 prefetch of a warp's first tile where its first batch does not cover its slice.
    const bool pf = f8_padded((W.cols + split - 1) / split) > F8Staged::kPiece;
    go(matvec_fp8_mma_kernel, blocks, kThreads, smem, static_cast<const uint8_t*>(W.p), W.row_scales(), W.group,
       W.rows, W.cols, xin, nw, c.rms_norm_eps, y, acc, split, pf ? 1 : 0, xcopy);
    mark(cls);
    return;
  }
  const int split = split_for(W.rows, W.cols, 16);
  const int rpb = kWarps / split;
  const void* fn = reinterpret_cast<const void*>(matvec_fp8_kernel);
  const size_t smem = nw ? size_t(W.cols) * 4 : 0;
  const int blocks = std::min((W.rows + rpb - 1) / rpb, prop.multiProcessorCount * per_sm(fn, smem));
  const int pf = pf_rows(size_t(W.rows) * W.cols, W.rows, blocks, rpb);
  const int per_warp = (W.rows + blocks * rpb - 1) / (blocks * rpb);
  const int rows = std::clamp(per_warp, 1, 4);
  go(matvec_fp8_kernel, blocks, kThreads, smem, static_cast<const uint8_t*>(W.p), W.row_scales(), W.group, W.rows,
     W.cols, xin, nw, c.rms_norm_eps, y, acc, split, pf, rows, xcopy);
  mark(cls);
}

// x += W_out . o and the folded router's logits, one launch (outproj_router_kernel).
void CudaModel::Impl::outproj_router(const DLayer& d, const DMat& W) {
  OutRouterArgs a;
  a.cat = cat;
  a.x = x;
  a.R = d.rfold;
  a.logits = rlogits;
  a.H = W.rows;
  a.O = W.cols;
  a.rowsR = d.router.rows;
  a.per = 2;
  a.E = int(c.num_experts);
  a.k = int(c.num_experts_per_tok);
  a.ids = eids;
  a.wscratch = presel_w;
  a.tc = d.tc;
  a.sel = ExpertSel{d.gu_tab, d.down_tab, sel};
  a.done = presel_done;
  a.splitR = split_for(a.rowsR, a.H + a.O, 4);
  if (const int split = W.dt == DT_FP8 ? f8_rows_split(W.cols, W.group) : 0; split && W.rows % 4 == 0) {
    // The projection by whole rows per warp (fp8_rows.cuh).
    const int sms = prop.multiProcessorCount;
    a.splitA = split;
    const size_t smem = f8_rows_smem(W.cols);
    const void* fn = reinterpret_cast<const void*>(outproj_router_fp8_rows_kernel);
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int resident = per_sm(fn, smem) * sms, rpb = kWarps / split;
    const int wantA = ((W.rows + kF8RowsR - 1) / kF8RowsR + rpb - 1) / rpb;
    // Both parts in one resident wave: the router's rows take fewer warps
    // each (more rows a block) where its blocks would not fit beside the
    // projection's (the last router block picks the experts gate_up waits
    // for; bench/NOTES-cuda.md, session 13).
    while (a.splitR > 1 &&
           std::min(wantA, sms) + (a.rowsR + kWarps / a.splitR - 1) / (kWarps / a.splitR) > resident)
      a.splitR /= 2;
    const int rpbR = kWarps / a.splitR;
    a.nbR = (a.rowsR + rpbR - 1) / rpbR;
    a.nbA = std::min(wantA, std::max(sms, resident - a.nbR));
    go(outproj_router_fp8_rows_kernel, a.nbA + a.nbR, kThreads, smem, static_cast<const uint8_t*>(W.p),
       W.row_scales(), W.group, a);
    mark(K_OUT);
    return;
  }
  if (W.dt == DT_FP8) {  // the projection on the tensor cores (fp8_router.cuh)
    const int sms = prop.multiProcessorCount, rpbR = kWarps / a.splitR;
    a.splitA = f8_mma_split(W.rows, W.cols, sms);
    const size_t smem = f8_outproj_smem(W.cols);
    const void* fn = reinterpret_cast<const void*>(outproj_router_fp8_kernel);
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int resident = per_sm(fn, smem) * sms, tpb = kWarps / a.splitA;
    a.nbR = (a.rowsR + rpbR - 1) / rpbR;
    a.nbA = std::min(((W.rows + 15) / 16 + tpb - 1) / tpb, std::max(sms, resident - a.nbR));
    go(outproj_router_fp8_kernel, a.nbR + a.nbA, kThreads, smem, static_cast<const uint8_t*>(W.p), W.row_scales(),
       W.group, a);
    mark(K_OUT);
    return;
  }
  a.splitA = split_for(W.rows, W.cols, int(16 / dt_size(W.dt)));
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

// Whether a layer's GGUF feed-forward (routed experts and/or the shared
// expert or dense MLP in GGUF blocks) runs on the staged kernels
// (gguf_staged.cuh), whose gate_up also picks the experts: every part in
// GGUF blocks, down matrices of one block kind, one warp per slot, and the
// shared memory fitting. S1, S2: their buffer bytes per warp.
static bool gguf_staged_ffn(const DLayer& d, int H, int I, int k, int optin, int& S1, int& S2) {
  if (d.rfold || k + (d.has_shared ? 1 : 0) > kDownSlotsMax || (k > 0 && (!d.gg.n || d.gd.n != 1))) return false;
  if (d.has_shared && (d.s_gu.dt != DT_GGUF || d.s_down.dt != DT_GGUF || d.s_down.g.n != 1)) return false;
  const GExperts ge{d.gg, d.gd, d.s_gu.g, d.s_down.g};
  const int Is = d.has_shared ? d.s_down.cols : 0;
  S1 = ggate_up_stage_bytes(ge, H, k, d.has_shared);
  S2 = gdown_stage_bytes(ge, I, Is, k, d.has_shared);
  const int big = optin - 4096;
  return size_t(H) * 4 + 16 + size_t(kWarps) * 2 * S1 <= size_t(big) &&
         size_t(S2) * (k + (d.has_shared ? 1 : 0)) <= size_t(big);
}
bool CudaModel::Impl::gguf_chunked(const DLayer& d) const {
  return !d.rfold && (!d.has_shared || (d.s_gu.dt == DT_GGUF && d.s_down.dt == DT_GGUF)) &&
         gc_experts_take(GExperts{d.gg, d.gd, d.s_gu.g, d.s_down.g}, int(c.hidden_size), int(c.moe_intermediate),
                         int(c.num_experts_per_tok), size_t(prop.sharedMemPerBlockOptin) - 4096);
}
bool CudaModel::Impl::gguf_picks(const DLayer& d) const {
  int S1, S2;
  return gguf_chunked(d) || gguf_staged(d, true, S1, S2);
}
bool CudaModel::Impl::gguf_staged(const DLayer& d, bool routed, int& S1, int& S2) const {
  if (!d.gg.n && d.s_gu.dt != DT_GGUF) return false;
  return gguf_staged_ffn(d, int(c.hidden_size), routed ? int(c.moe_intermediate) : 0,
                         routed ? int(c.num_experts_per_tok) : 0, int(prop.sharedMemPerBlockOptin), S1, S2);
}

// Router logits, then the top-k kernel unless gate_up picks (pick_in_kernels:
// bf16 and FP8 experts, GGUF experts on the staged kernels).
void CudaModel::Impl::route(const DLayer& d) {
  const bool pick = opts.decode.pick_in_kernels;
  matvec(d.router, x, d.post_norm, rlogits, 0, K_ROUTER);
  if (pick && (d.gg.n ? gguf_picks(d) : (!d.q.bits || d.q.fp8))) return;  // gate_up does the top-k
  const ExpertSel es{d.gu_tab, d.down_tab, pick ? sel : nullptr};
  go(topk_kernel, 1, 32, 0, rlogits, int(c.num_experts), int(c.num_experts_per_tok), c.norm_topk_prob ? 1 : 0,
     d.has_shared ? 1 : 0, eids, ew, d.tc, es);
  mark(K_ROUTER);
}

// Blocks per query head in attn_kernel (a cluster, each a slice of the
// positions): one per 256 positions of KV capacity, 1 to 8, so a long
// context is read by up to 8x as many SMs (one per 1024 left a 2048
// window on 2 blocks per head: h2b in bench/NOTES-cuda.md). The graph is
// captured per capacity (ensure_cap drops it), so this follows the cache.
int CudaModel::Impl::attn_blocks(int cap, int hd) const {
  using Split = DecodeOptions::AttentionSplit;
  const Split mode = opts.decode.attention_split;
  if (hd % 8 || hd > 256 || mode == Split::Off) return 1;  // attn_kernel's vec path only
  if (mode == Split::Force) return 4;  // tests
  return std::clamp(cap / 256, 1, 8);
}

// The delta step on delta_cluster_kernel (a cluster of blocks per head) where
// its shapes allow; false: the caller launches delta_kernel.
bool CudaModel::Impl::delta_cluster(const DeltaArgs& a) {
  int cpb = opts.decode.force_small_delta_clusters ? 8 : 32;  // 8 (tests): clusters even on small heads
  if (a.dv % cpb || a.dv / cpb > 8) cpb = 32;
  if (a.dv % cpb || a.dv / cpb > 8) return false;
  cluster_next = a.dv / cpb;
  const dim3 grid(a.nv * (a.dv / cpb));
  auto run = [&](auto kern, int threads) { go(kern, grid, threads, 0, a); };
  if (cpb == 32) {
    if (a.dk == 128) run(delta_cluster_kernel<128, 32, 8>, 256);
    else if (a.dk == 64) run(delta_cluster_kernel<64, 32, 8>, 256);
    else if (a.dk == 32) run(delta_cluster_kernel<32, 32, 8>, 256);
    else return cluster_next = 1, false;
  } else {
    if (a.dk == 128) run(delta_cluster_kernel<128, 8, 8>, 64);
    else if (a.dk == 64) run(delta_cluster_kernel<64, 8, 8>, 64);
    else if (a.dk == 32) run(delta_cluster_kernel<32, 8, 8>, 64);
    else return cluster_next = 1, false;
  }
  return true;
}

template <typename T>
void CudaModel::Impl::moe_launch(const MoeArgs& a, int slots) {
  dim3 g1((a.maxI + kWarps - 1) / kWarps, slots);
  go(gate_up_kernel<T>, g1, kThreads, size_t(a.H) * 4, a);
  mark(K_EXPERTS);
  if (slots >= 2 && slots <= kDownSlotsMax) {
    // 8 rows per warp when that grid is one resident wave (the 35B: 256
    // blocks of 9 warps, 2 per SM), else 4 (fewer registers per thread).
    auto waves = [&](const void* fn, int R) {
      const int blocks = (a.H + R - 1) / R, resident = per_sm(fn, 0, slots * 32) * prop.multiProcessorCount;
      return (blocks + resident - 1) / resident;
    };
    const bool r8 = waves(reinterpret_cast<const void*>(down_slots_kernel<T, 8>), 8) <=
                    waves(reinterpret_cast<const void*>(down_slots_kernel<T, 4>), 4);
    // down_early_kernel: the rows in registers before the wait when the pick
    // was final two kernels back (not made by gate_up itself).
    const int ch = (std::max(a.I, a.Is) * int(sizeof(T)) + 511) / 512;  // 16-byte chunks per lane and row
    const int early = !a.logits || a.presel ? 1 : 0;
    if (r8 && ch == 1) go(down_early_kernel<T, 8, 1>, (a.H + 7) / 8, slots * 32, 0, a, early);
    else if (r8 && ch == 2) go(down_early_kernel<T, 8, 2>, (a.H + 7) / 8, slots * 32, 0, a, early);
    else if (!r8 && ch <= 4) go(down_early_kernel<T, 4, 4>, (a.H + 3) / 4, slots * 32, 0, a, early);
    else if (r8) go(down_slots_kernel<T, 8>, (a.H + 7) / 8, slots * 32, 0, a);
    else go(down_slots_kernel<T, 4>, (a.H + 3) / 4, slots * 32, 0, a);
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

// The experts of a layer of quantised experts (shared expert in storage
// type sdt); BITS 0: FP8 blocks (fp8_experts.cuh).
template <int BITS>
void CudaModel::Impl::moe_launch_q(const MoeArgs& a, int slots, const QExpert& q, int sdt) {
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
    release_copies();
    go(dn, blocks, kThreads, s2, a, q);
    mark(K_EXPERTS);
  };
  if constexpr (BITS == 0) {
    // On the tensor cores (fp8_experts.cuh) where the blocks are a multiple
    // of 64 columns wide: gate_up in tiles of 8 h rows (kGuSplit warps
    // each), down in tiles of 16 x rows (a block of kDnWarps warps each).
    if (q.group % kF8Step == 0 && (sdt != DT_FP8 || !a.has_shared || a.s_group % kF8Step == 0)) {
      const bool f8s = sdt == DT_FP8;  // the kernels' TS = F8Rows
      const size_t m1 = f8_mma_gate_up_smem(a.H, f8_gate_up_xf(a, f8s));
      const int dw = f8_down_warps(a, f8s);
      const size_t m2 = f8_mma_down_smem(a.k, a.I, a.Is, f8s && a.has_shared, dw);
      auto mma = [&](auto gu, auto dn) {
        if (m1 > 48 * 1024) CK(cudaFuncSetAttribute(gu, cudaFuncAttributeMaxDynamicSharedMemorySize, int(m1)));
        if (m2 > 48 * 1024) CK(cudaFuncSetAttribute(dn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(m2)));
        if (f8x_gate_up_takes(a, q, f8s, size_t(prop.sharedMemPerBlockOptin) - 4096)) {
          launch_gate_up_fp8_smem(*this, a, q, slots);  // gate_up by whole rows through shared memory
        } else {
          const int resident = per_sm(reinterpret_cast<const void*>(gu), m1) * prop.multiProcessorCount;
          const int tpb = kWarps / kGuSplit, need = ((a.maxI + 7) / 8 + tpb - 1) / tpb;
          go(gu, dim3(std::max(1, std::min(need, resident / slots)), slots), kThreads, m1, a, q);
        }
        mark(K_EXPERTS);
        const int dres = per_sm(reinterpret_cast<const void*>(dn), m2, dw * 32) * prop.multiProcessorCount;
        go(dn, std::min((a.H + 15) / 16, dres), dw * 32, m2, a, q);
        mark(K_EXPERTS);
      };
      switch (sdt) {
        case DT_FP8: mma(gate_up_fp8_mma_kernel<F8Rows>, down_fp8_mma_kernel<F8Rows>); break;
        case DT_F32: mma(gate_up_fp8_mma_kernel<float>, down_fp8_mma_kernel<float>); break;
        case DT_F16: mma(gate_up_fp8_mma_kernel<__half>, down_fp8_mma_kernel<__half>); break;
        default: mma(gate_up_fp8_mma_kernel<__nv_bfloat16>, down_fp8_mma_kernel<__nv_bfloat16>);
      }
      return;
    }
    switch (sdt) {
      case DT_FP8: run(gate_up_fp8_kernel<F8Rows>, down_fp8_kernel<F8Rows>); break;
      case DT_F32: run(gate_up_fp8_kernel<float>, down_fp8_kernel<float>); break;
      case DT_F16: run(gate_up_fp8_kernel<__half>, down_fp8_kernel<__half>); break;
      default: run(gate_up_fp8_kernel<__nv_bfloat16>, down_fp8_kernel<__nv_bfloat16>);
    }
  } else {
    switch (sdt) {
      case DT_F32: run(gate_up_q_kernel<BITS, float>, down_q_kernel<BITS, float>); break;
      case DT_F16: run(gate_up_q_kernel<BITS, __half>, down_q_kernel<BITS, __half>); break;
      default: run(gate_up_q_kernel<BITS, __nv_bfloat16>, down_q_kernel<BITS, __nv_bfloat16>);
    }
  }
}

void CudaModel::Impl::moe_launch_q(const MoeArgs& a, int slots, const QExpert& q, int sdt) {
  if (q.fp8) moe_launch_q<0>(a, slots, q, sdt);
  else if (q.bits == 8) moe_launch_q<8>(a, slots, q, sdt);
  else moe_launch_q<4>(a, slots, q, sdt);
}

// A GatedDeltaNet layer's mixer (state slot sl): in-proj (input norm
// fused), conv1d, the delta-rule step, out-proj (+ the folded router).
void CudaModel::Impl::delta_net(CudaState::Impl& s, const DLayer& d, int sl) {
  const ModelConfig& m = c;
  const int nv = int(m.lin_num_v_heads), dk = int(m.lin_k_dim), dv = int(m.lin_v_dim);
  const int C = int(m.lin_conv_dim()), K = int(m.conv_kernel);
  matvec(d.lin_in, x, d.in_norm, proj, 0, K_PROJ, d.rfold ? cat : nullptr);
  go(conv_kernel, (C + 255) / 256, 256, 0, proj, C, K, d.conv_w, s.conv[size_t(sl)], convout);
  mark(K_CONV);
  DeltaArgs a;
  fill_delta_layer(a, m, d);
  a.conv = convout;
  a.proj = proj;
  a.S = s.ssm[size_t(sl)];
  a.out = lin_o;
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
// norm fused), rope + KV store, quest's choice of pages, attention, h2o's
// scores, o_proj (+ the folded router).
void CudaModel::Impl::attention(CudaState::Impl& s, const DLayer& d, int sl) {
  const ModelConfig& m = c;
  const int nh = int(m.num_heads), nkv = int(m.num_kv_heads), hd = int(m.head_dim);
  matvec(d.qkv, x, d.in_norm, proj, 0, K_PROJ, d.rfold ? cat : nullptr);
  const AttnPrepArgs p = attn_prep_args(m, d, proj, q, s.d_pos, inv_freq, s.kvl[size_t(sl)], s.ns, s.kvt);
  go(attn_prep_kernel, nh + 1, 128, size_t(std::max(hd, 2 * nkv * hd)) * 4, p);
  mark(K_ATTN);
  // Rotated (fp8 `rotated`): gated by rot_gate_kernel below.
  const KvLayer& kv = s.kvl[size_t(sl)];
  AttnArgs a = attn_args(m, q, kv.rot ? nullptr : proj, s.scores, attn_o, s.d_pos, kv, s.ns);
  a.prefetch = 1;
  if (kv.quest) {  // the pages this query reads (quest.cuh)
    go(quest_score_kernel, quest_score_blocks(kv, nkv), kQuestWarps * 32, size_t(nh / nkv) * hd * 4, kv,
       static_cast<const float*>(q), static_cast<const int*>(s.d_pos), s.kvt, nh, nkv, hd, s.ns);
    go(quest_select_kernel, nkv, kQuestSelectThreads, 0, kv, static_cast<const int*>(s.d_pos), nkv, hd * int(s.el));
    mark(K_ATTN);
  }
  const int groups = std::max(8, 256 / hd);  // 8: the warps' partials (attn_kernel)
  const size_t smem = size_t(2 * hd + groups * hd) * 4;
  a.split = attn_blocks(attn_positions(s), hd);
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
  if (s.kvl[size_t(sl)].rot) {
    go(rot_gate_kernel, nh, 128, size_t(hd) * 4, attn_o, static_cast<const float*>(proj), 0, nh, hd);
    mark(K_ATTN);
  }
  if (d.rfold) outproj_router(d, d.o_proj);
  else matvec(d.o_proj, attn_o, nullptr, x, 1, K_OUT);
}

// The feed-forward's arguments common to routed and dense layers.
MoeArgs CudaModel::Impl::ffn_args(const DLayer& d) const {
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
void CudaModel::Impl::ffn_launch(const DLayer& d, const MoeArgs& a, int slots) {
  if (d.gg.n || d.s_gu.dt == DT_GGUF) {
    const GExperts ge{d.gg, d.gd, d.s_gu.g, d.s_down.g};
    if (a.k > 0 && gguf_chunked(d)) {
      gc_experts_launch(*this, a, ge, slots, d.s_gu_c, d.s_down_c, [&] { mark(K_EXPERTS); });
      return;
    }
    int S1, S2;
    if (gguf_staged(d, a.k > 0, S1, S2)) {
      const size_t s1 = size_t(a.H) * 4 + 16 + size_t(kWarps) * 2 * S1;
      const int resident =
          per_sm(reinterpret_cast<const void*>(ggate_up_staged_kernel), s1) * prop.multiProcessorCount;
      const dim3 g1(std::max(1, std::min((a.maxI + kWarps - 1) / kWarps, resident / slots)), slots);
      go(ggate_up_staged_kernel, g1, kThreads, s1, a, ge, S1);
      mark(K_EXPERTS);
      const size_t s2 = size_t(S2) * slots;
      auto fn = [](int R) {
        return R == 1   ? reinterpret_cast<const void*>(gdown_staged_kernel<1>)
               : R == 2 ? reinterpret_cast<const void*>(gdown_staged_kernel<2>)
               : R == 4 ? reinterpret_cast<const void*>(gdown_staged_kernel<4>)
                        : reinterpret_cast<const void*>(gdown_staged_kernel<kDownRun>);
      };
      const int R = gdown_rows(a.H, [&](int r) { return per_sm(fn(r), s2, slots * 32) * prop.multiProcessorCount; });
      const int nb = (a.H + R - 1) / R;
      if (R == 1) go(gdown_staged_kernel<1>, nb, slots * 32, s2, a, ge, S2);
      else if (R == 2) go(gdown_staged_kernel<2>, nb, slots * 32, s2, a, ge, S2);
      else if (R == 4) go(gdown_staged_kernel<4>, nb, slots * 32, s2, a, ge, S2);
      else go(gdown_staged_kernel<kDownRun>, nb, slots * 32, s2, a, ge, S2);
      mark(K_EXPERTS);
      return;
    }
    const size_t smem = size_t(a.H) * 4;
    const int resident = per_sm(reinterpret_cast<const void*>(ggate_up_kernel), smem) * prop.multiProcessorCount;
    const dim3 g1(std::max(1, std::min((a.maxI + kWarps - 1) / kWarps, resident / slots)), slots);
    go(ggate_up_kernel, g1, kThreads, smem, a, ge);
    mark(K_EXPERTS);
    go(gdown_kernel, std::min((a.H + kWarps - 1) / kWarps, prop.multiProcessorCount * kBlocksPerSm), kThreads, 0, a,
       ge);
    mark(K_EXPERTS);
    return;
  }
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
void CudaModel::Impl::routed_moe(const DLayer& d, int mi) {
  const ModelConfig& m = c;
  const bool pick = opts.decode.pick_in_kernels;
  MoeArgs a = ffn_args(d);
  a.sel = pick ? sel : nullptr;
  if (!d.rfold) route(d);  // else the logits came with the output projection
  if (disk) disk_fetch(mi);
  const unsigned seq = prefetches(d) ? prefetch_copy(d, mi) : 0;
  a.gu_tab = d.gu_tab;
  a.down_tab = d.down_tab;
  a.k = int(m.num_experts_per_tok);
  a.I = int(m.moe_intermediate);
  a.w = ew;
  a.has_shared = d.has_shared ? 1 : 0;
  a.s_gu = d.s_gu.p;
  a.s_down = d.s_down.p;
  if (d.s_gu.dt == DT_FP8) {
    a.s_gu_sc = d.s_gu.row_scales();
    a.s_down_sc = d.s_down.row_scales();
    a.s_group = d.s_gu.group;
  }
  a.Is = d.has_shared ? d.s_down.cols : 0;
  const int slots = a.k + a.has_shared;
  if (pick && (d.gg.n ? gguf_picks(d) : (!d.q.bits || d.q.fp8 || d.rfold))) {
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
    a.sel_ready = a.presel;  // picked by the output projection's launch, two kernels before down
  }
  if (seq) {
    a.pf_slot = pf_slot;
    a.pf_flag = pf_flag;
    a.pf_seq = seq;
    a.pf_stuck = &pf_rest_dev->stuck;
    rest_seq = seq;
    rest_mi = mi;
  }
  if (ep) ep_before_ffn();
  ffn_launch(d, a, slots);
  release_copies();  // where the launch did not (it does right after gate_up)
  if (ep) ep_after_ffn();
}

// A dense SwiGLU MLP: the expert kernels with one slot (weight 1).
void CudaModel::Impl::dense_mlp(const DLayer& d) {
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
void CudaModel::Impl::enqueue_step(CudaState::Impl& s, int kind) {
  const ModelConfig& m = c;
  const int H = int(m.hidden_size);
  pdl_next = false;
  switch (embed.dt) {
    case DT_GGUF:
      go(gembed_kernel, (H / 8 + 255) / 256, 256, 0, static_cast<const void*>(embed.p), embed.g, H, s.d_ids, s.d_pos,
         s.d_base, kRing, x);
      break;
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
    // Copied during the mixer (prefetch_next: only the step's first MoE layer; the others' at the previous router).
    if (l.ffn == FfnKind::RoutedMoE && prefetch_n > 0 && prefetches(d) && (!prefetch_next || l.moe_slot == 0))
      prefetch_pick(d);
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
       s.d_step, static_cast<const char*>(embed.p), embed.row_bytes());
    mark(K_ARGMAX);
  }
  go(advance_kernel, 1, 1, 0, s.d_pos, s.d_step);
  check(cudaGetLastError(), "advance");
}

bool CudaModel::Impl::prefetches(const DLayer& d) const {
  return host_copies && tiers && !disk && d.tc.tier && d.q.bits && !d.q.fp8 && !d.gg.n && d.router.p &&
         d.router.cols == int(c.hidden_size) && d.router.rows >= int(c.num_experts) &&
         (d.router.dt == DT_BF16 || d.router.dt == DT_F16 || d.router.dt == DT_F32) && c.hidden_size <= 8192 &&
         d.q.gu_bytes == pf_gu && d.q.dn_bytes == pf_dn;
}

void CudaModel::Impl::prefetch_pick(const DLayer& d) {
  PredictArgs a;
  a.E = int(c.num_experts);
  a.H = int(c.hidden_size);
  a.n = prefetch_n;
  a.x = x;
  a.nw = d.post_norm;
  a.eps = c.rms_norm_eps;
  a.logits = pf_logits;
  a.done = pf_done;
  a.tier = d.tc.tier;
  a.gu_tab = d.gu_tab;
  a.down_tab = d.down_tab;
  a.src = pf_src;
  a.pick = pf_pick_dev;
  a.lowest = opts.decode.prefetch_mispredict ? 1 : 0;
  const dim3 g((a.E + kWarps - 1) / kWarps);
  const size_t smem = size_t(a.H) * 4;
  // No PDL: the pick starts after the previous layer's expert kernels end,
  // so when the host sees it complete the staging area is free; with the
  // waits in the expert kernels, after the previous layer's copies too.
  // prefetch_next: the copies go to staging slots whose readers are done
  // (prefetch_rest), and this layer's own copies must not wait for the pick.
  if (pf_outstanding && !prefetch_next) {
    CK(cudaStreamWaitEvent(stream, pf_copied, 0));
    pf_outstanding = false;
  }
  pdl_next = false;
  switch (d.router.dt) {
    case DT_F32: go(predict_pick_kernel<float>, g, kThreads, smem, static_cast<const float*>(d.router.p), a); break;
    case DT_F16: go(predict_pick_kernel<__half>, g, kThreads, smem, static_cast<const __half*>(d.router.p), a); break;
    default:
      go(predict_pick_kernel<__nv_bfloat16>, g, kThreads, smem, static_cast<const __nv_bfloat16*>(d.router.p), a);
  }
  mark(K_ROUTER);
  CK(cudaEventRecord(pf_picked, stream));
}

const DLayer* CudaModel::Impl::next_moe(int mi) const {
  for (const LayerPlan& l : plan.layers)
    if (l.ffn == FfnKind::RoutedMoE && l.moe_slot == mi + 1) {
      const DLayer& d = L[size_t(l.index)];
      return prefetches(d) ? &d : nullptr;
    }
  return nullptr;
}

unsigned CudaModel::Impl::prefetch_copy(const DLayer& d, int mi) {
  const unsigned seq = ++pf_seq;
  const int pbase = prefetch_next ? (mi % 2) * (kPrefetchMax / 2) : 0;
  int n = 0;
  if (prefetch_n > 0 && prefetch_next && mi > 0) {
    n = pf_next_n;  // issued after the previous MoE layer's copies (prefetch_rest)
    pf_next_n = 0;
  } else if (prefetch_n > 0) {
    // The mixer is enqueued behind the pick: the device stays busy while the
    // host waits here and issues the copies.
    CK(cudaEventSynchronize(pf_picked));
    for (int p = 0; p < prefetch_n; ++p) {
      const void* g = pf_pick->gu[p];
      const void* dn = pf_pick->dn[p];
      if (!g || !dn) continue;
      uint8_t* to = pf_stage + size_t(pbase + p) * (pf_gu + pf_dn);
      CK(cudaMemcpyAsync(to, g, pf_gu, cudaMemcpyDefault, pf_stream));
      CK(cudaMemcpyAsync(to + pf_gu, dn, pf_dn, cudaMemcpyDefault, pf_stream));
      flag_copied(pbase + p, seq);
      ++n;
    }
    if (n > 0) {
      pf_copies += uint64_t(n);
      CK(cudaEventRecord(pf_copied, pf_stream));
      pf_outstanding = true;  // the next pick at a layer's start waits for them
    }
  }
  go(stage_sel_kernel, 1, 32, 0, sel, int(c.num_experts_per_tok), static_cast<const void* const*>(pf_src),
     n > 0 ? prefetch_n : 0, pbase, pf_stage, pf_gu, pf_dn, pf_used, pf_slot, static_cast<const int*>(eids),
     d.tc.tier, pf_rest_dev);
  mark(K_EXPERTS);
  // prefetch_next: the next MoE layer's pick, from this layer's residual
  // before its experts (stage_sel_kernel has read this layer's sources).
  pf_has_next = false;
  if (prefetch_next && prefetch_n > 0)
    if (const DLayer* nd = next_moe(mi)) {
      prefetch_pick(*nd);
      pf_has_next = true;
    }
  CK(cudaEventRecord(pf_staged, stream));
  return seq;
}

// The copies the layer's gate_up kernel (just launched) waits for, issued
// before anything else is launched: the first launch of a kernel may load
// its module, and CUDA's lazy loading may synchronise the context to do
// so, which would wait for the gate_up kernel while it waits for copies
// the host had not issued yet (the 397B after a prompt hung so, with the
// decode step's kernels first launched there and VRAM nearly full).
void CudaModel::Impl::release_copies() {
  if (!rest_seq) return;
  const unsigned seq = rest_seq;
  rest_seq = 0;
  prefetch_rest(seq, rest_mi);
}

void CudaModel::Impl::prefetch_rest(unsigned seq, int mi) {
  // The expert kernels are enqueued: their blocks of a listed slot wait for its flag.
  CK(cudaEventSynchronize(pf_staged));
  if (reinterpret_cast<volatile PrefetchRest*>(pf_rest)->stuck)
    fail("CUDA backend: an expert kernel waited more than " + std::to_string(kCopyWaitLimitNs / 1000000000ull) +
         " s for a host-tier expert's copy that never arrived (bench --host-copies off avoids the copy path)");
  int n = 0;
  for (int j = 0; j < int(c.num_experts_per_tok); ++j) {
    const void* g = pf_rest->gu[j];
    const void* dn = pf_rest->dn[j];
    if (!g || !dn) continue;
    uint8_t* to = pf_stage + size_t(kPrefetchMax + j) * (pf_gu + pf_dn);
    CK(cudaMemcpyAsync(to, g, pf_gu, cudaMemcpyDefault, pf_stream));
    CK(cudaMemcpyAsync(to + pf_gu, dn, pf_dn, cudaMemcpyDefault, pf_stream));
    flag_copied(kPrefetchMax + j, seq);
    ++n;
  }
  pf_rest_copies += uint64_t(n);
  if (pf_has_next) {
    // The next MoE layer's copies ahead, behind this layer's: into the other
    // parity's staging slots, last read two MoE layers back (done: this
    // layer's router followed them); flagged with the next layer's number.
    const int nb = ((mi + 1) % 2) * (kPrefetchMax / 2);
    int m = 0;
    for (int p = 0; p < prefetch_n; ++p) {
      const void* g = pf_pick->gu[p];
      const void* dn = pf_pick->dn[p];
      if (!g || !dn) continue;
      uint8_t* to = pf_stage + size_t(nb + p) * (pf_gu + pf_dn);
      CK(cudaMemcpyAsync(to, g, pf_gu, cudaMemcpyDefault, pf_stream));
      CK(cudaMemcpyAsync(to + pf_gu, dn, pf_dn, cudaMemcpyDefault, pf_stream));
      flag_copied(nb + p, seq + 1);
      ++m;
    }
    pf_next_n = m;
    pf_copies += uint64_t(m);
    n += m;
  }
  if (n == 0) return;
  CK(cudaEventRecord(pf_copied, pf_stream));
  pf_outstanding = true;
}

void CudaModel::Impl::flag_copied(int p, unsigned seq) {
  if (write_value32) {
    using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
    const CUresult r = reinterpret_cast<Fn>(write_value32)(pf_stream, CUdeviceptr(pf_flag + p), seq,
                                                           CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r != CUDA_SUCCESS) fail("cuStreamWriteValue32 failed (" + std::to_string(int(r)) + ")");
    return;
  }
  // A ring of values in pinned memory: a copy reads its value when it runs,
  // at most a few layers after it was issued.
  unsigned* v = pf_seq_host + seq % kSeqRing;
  *v = seq;
  CK(cudaMemcpyAsync(pf_flag + p, v, 4, cudaMemcpyHostToDevice, pf_stream));
}

void CudaModel::Impl::disk_fetch(int mi) {
  const int k = int(c.num_experts_per_tok);
  fetch_experts(mi, eids, k);
  pdl_next = false;  // the expert kernels start after the table updates, not during them
}

// The n expert ids at d_ids (device) of MoE layer mi resident, tables set on the stream.
void CudaModel::Impl::fetch_experts(int mi, const int* d_ids, int n) {
  CK(cudaMemcpyAsync(pinned_eids, d_ids, size_t(n) * 4, cudaMemcpyDeviceToHost, stream));
  CK(cudaStreamSynchronize(stream));
  tiers->ensure(stream, mi, pinned_eids, n);
}
}  // namespace flashmoe
