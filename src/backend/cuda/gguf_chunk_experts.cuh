// The decode step's routed-expert kernels for GGUF experts in the chunk
// layout (gguf_chunks.cuh: Q4_K / Q6_K rearranged at upload), shaped as the
// q4 experts' (quant_experts.cuh): a lane's 16-byte chunk of codes is 32
// weights with one f32 scale (and min), x staged chunk-major in shared
// memory (stage_chunks<4>: lanes on consecutive chunks read consecutive
// float4s), kGcLoads chunks in flight per lane, issued as soon as the rows
// are known. gate_up picks the experts itself from the router's logits
// (pick_block_expert, as the staged GGUF and the bf16 kernels do), and
// down repeats that pick before its PDL wait and loads its first chunks
// across it. The shared expert (slot k) is read as one more routed slot
// where upload.cu made it a copy in the chunk layout (gc_shared_joins: it
// is stored as the routed experts are), else from its stored GGUF rows
// (gguf_lane_row_dot). Both kernels take the routed experts' kind as a
// template argument where it is one kind (gc_experts_launch), so the
// chunk readers carry no kind switch.
// Used where every routed expert is in VRAM (upload.cu repacks only
// there); tiered experts keep the file's layout and gguf_staged.cuh.
#pragma once
#include <type_traits>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/gguf_chunks.cuh"
#include "backend/cuda/gguf_kernels.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/quant_experts.cuh"

namespace flashmoe::cuda {

constexpr int kGcLoads = 4;  // chunks each lane has in flight

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j (j
// == k: the shared expert). A warp's row pair is 2 * H / 32 chunks spread
// over the lanes, kGcLoads a lane at a time. KG: the routed gate and up
// rows' kind, or -1 (read per row). SC: the shared expert is in the chunk
// layout too (gc_shared_joins): its slot is one more routed slot whose
// rows are known before the wait, so its first chunks load across it
// (+4.4% tokens/s with down's part of it, session 16); else its stored
// rows (gguf_lane_row_dot). Three blocks an SM (80 registers; SC false
// spills about 100 bytes, SC true 32): at the 35B shape the 9 slots' blocks are
// then all resident at once, where at two an SM (103 registers) a third
// of the warps took a third row pair after the others ended (+2.5%,
// session 15); four an SM lost in both sessions (bench/NOTES-cuda.md).
template <int KG, bool SC>
static __global__ void __launch_bounds__(kThreads, 3) gc_gate_up_kernel(MoeArgs a, GExperts ge) {
  extern __shared__ __align__(16) float xs[];  // [H] x normed, [H] chunk-major, [H / 8] sums
  const int j = blockIdx.y;
  const bool shared = j == a.k, stored = !SC && shared;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r_first = blockIdx.x * kWarps + warp, step = gridDim.x * kWarps;
  const GMat& g = stored ? ge.sgu : ge.gu;
  const int cpr = a.H / 32;
  const void* B = a.s_gu;
  int kg = 0, ku = 0;
  const uint8_t *gr = nullptr, *ur = nullptr;
  auto rows = [&](int r) {
    gr = gmat_row(g, B, a.H, r, kg);
    ur = gmat_row(g, B, a.H, I + r, ku);
    if (KG >= 0 && !stored) kg = ku = KG;
  };
  GChunk L[kGcLoads];
  auto issue = [&](int i0) {
FM_UNROLL
    for (int t = 0; t < kGcLoads; ++t) {
      const int idx = i0 + 32 * t;
      const bool up = idx >= cpr;
      if (idx < 2 * cpr) gchunk_load(up ? ku : kg, up ? ur : gr, up ? idx - cpr : idx, L[t]);
    }
  };
  if (stored) {  // its rows are known before the wait
    for (int r = r_first; r < I; r += step)
      for (int part = 0; part < 2; ++part) {
        int kind;
        const uint8_t* row = gmat_row(g, a.s_gu, a.H, part * I + r, kind);
        warp_prefetch(row, gguf_row_bytes(kind, a.H), lane);
      }
  } else if (shared && r_first < I) {  // in flight across the wait
    rows(r_first);
    issue(lane);
  } else if (a.logits && warp == 0) {
    prefetch_tables(a.tsel, a.E);
  }
  NormPre pre;
  norm_preload(a.norm_w, a.H, true, pre);
  pdl_wait();
  pdl_trigger();
  if (!shared) {
    B = a.logits ? pick_block_expert(a, j, 1.0f) : a.sel ? a.sel[j] : a.gu_tab[a.ids[j]];
    if (r_first < I) {  // in flight while x is normed and staged
      rows(r_first);
      issue(lane);
    }
  }
  load_x(a.x, a.norm_w, a.eps, a.H, xs, &pre);
  const float* xq = xs + a.H;
  const float* s8 = xs + 2 * a.H;
  stage_chunks<4>(xs, a.H, reinterpret_cast<float4*>(xs + a.H), xs + 2 * a.H);
  __syncthreads();
  for (int r = r_first; r < I; r += step) {
    float gv = 0.f, uv = 0.f;
    if (stored || r != r_first) rows(r);
    if (stored) {
      gv = gguf_lane_row_dot(kg, gr, xs, a.H, lane);
      uv = gguf_lane_row_dot(ku, ur, xs, a.H, lane);
    } else {
      for (int i0 = lane; i0 < 2 * cpr; i0 += 32 * kGcLoads) {
        if (r != r_first || i0 != lane) issue(i0);
FM_UNROLL
        for (int t = 0; t < kGcLoads; ++t) {
          const int idx = i0 + 32 * t;
          const bool up = idx >= cpr;
          const int ch = up ? idx - cpr : idx;
          if (idx < 2 * cpr) {
            const float d = gchunk_dot(up ? ku : kg, L[t], xq + 4 * ch, s8 + ch, cpr);
            if (up) uv += d;
            else gv += d;
          }
        }
      }
    }
    gv = warp_sum(gv);
    uv = warp_sum(uv);
    if (lane == 0) a.hb[j * a.maxI + r] = siluf_(gv) * uv;
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j, one warp a row: the slots' h
// staged chunk-major, the row's chunks of all slots read in the chunk
// layout (k * I / 32; SC: k + 1, the shared expert the last) spread over
// the lanes, kGcLoads a lane at a time (the first issued before h is
// staged; before the wait where the pick is repeated here), each weighted
// by its slot's w; then (SC false) the shared expert's stored row. One
// warp sum a row. KD: the rows' kind. NL: the chunks each lane has in
// flight. The shared expert in the chunk layout (SC) took down from 128
// registers to 64, and the first chunks across the wait gave +2.3%
// tokens/s on top of it (bench/NOTES-cuda.md, session 16).
template <int KD, bool SC, int NL>
static __global__ void __launch_bounds__(kThreads) gc_down_kernel(MoeArgs a, GExperts ge) {
  extern __shared__ __align__(16) float4 hq[];  // [slots][I / 4] chunk-major, then [slots][I / 8] sums
  __shared__ const uint8_t* ptr[33];
  __shared__ const void* chosen[64];
  __shared__ int cid[32];
  __shared__ float wj[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k = a.k, ks = SC ? k + 1 : k;
  const int r_first = blockIdx.x * kWarps + warp, step = gridDim.x * kWarps;
  if (!SC && a.has_shared && r_first < a.H) {  // its rows are known before the wait
    int kind;
    const uint8_t* row = gmat_row(ge.sdn, a.s_down, a.Is, r_first, kind);
    warp_prefetch(row, gguf_row_bytes(kind, a.Is), lane);
  }
  if (SC && threadIdx.x == 0) ptr[k] = static_cast<const uint8_t*>(a.s_down) + ge.dn.off[0];
  // Where gate_up picks the experts from the router's logits, those logits
  // were complete before gate_up started (the router's kernel is two
  // kernels back): the block repeats the pick (the same top-k, so the same
  // experts) before its wait, and its first chunks load across the wait
  // (the weights are not gate_up's output). The weights w are gate_up's
  // (block (0,0) publishes them), read after the wait.
  const bool early = a.logits && !a.presel;
  if (early) {
    if (warp == 0)
      topk_warp(a.logits, a.E, k, a.norm_topk, a.has_shared, cid, wj, TierCount{nullptr, nullptr, nullptr},
                ExpertSel{a.tsel.gu_tab, a.tsel.down_tab, chosen});
    __syncthreads();
    if (int(threadIdx.x) < k) ptr[threadIdx.x] = static_cast<const uint8_t*>(chosen[k + threadIdx.x]) + ge.dn.off[0];
  }
  const int cpr = a.I / 32, n = ks * cpr, kd = KD;
  const size_t rb = gguf_row_bytes(kd, a.I);
  GChunk L[NL];
  auto issue = [&](int r, int i0) {
FM_UNROLL
    for (int t = 0; t < NL; ++t) {
      const int idx = i0 + 32 * t, sl = idx / cpr;
      if (idx < n) gchunk_load(kd, ptr[sl] + size_t(r) * rb, idx - sl * cpr, L[t]);
    }
  };
  if (early) {
    __syncthreads();
    if (r_first < a.H) issue(r_first, lane);
  }
  pdl_wait();
  pdl_trigger();
  if (!early && int(threadIdx.x) < k)
    ptr[threadIdx.x] =
        static_cast<const uint8_t*>(a.sel ? a.sel[k + threadIdx.x] : a.down_tab[a.ids[threadIdx.x]]) + ge.dn.off[0];
  if (int(threadIdx.x) < k + a.has_shared) wj[threadIdx.x] = a.w[threadIdx.x];
  __syncthreads();
  if (!early && r_first < a.H) issue(r_first, lane);  // in flight while h is staged
  float* s8 = reinterpret_cast<float*>(hq + ks * (a.I / 4));
  for (int j = 0; j < ks; ++j) stage_chunks<4>(a.hb + j * a.maxI, a.I, hq + j * (a.I / 4), s8 + j * (a.I / 8));
  __syncthreads();
  for (int r = r_first; r < a.H; r += step) {
    float acc = 0.f;
    for (int i0 = lane; i0 < n; i0 += 32 * NL) {
      if (r != r_first || i0 != lane) issue(r, i0);
FM_UNROLL
      for (int t = 0; t < NL; ++t) {
        const int idx = i0 + 32 * t, sl = idx / cpr, ch = idx - sl * cpr;
        if (idx < n)
          acc += wj[sl] * gchunk_dot(kd, L[t], reinterpret_cast<const float*>(hq + sl * (a.I / 4) + ch),
                                     s8 + sl * (a.I / 8) + ch, cpr);
      }
    }
    if (!SC && a.has_shared) {
      int kind;
      const uint8_t* row = gmat_row(ge.sdn, a.s_down, a.Is, r, kind);
      acc += wj[k] * gguf_lane_row_dot(kind, row, a.hb + k * a.maxI, a.Is, lane);
    }
    acc = warp_sum(acc);
    if (lane == 0) a.x[r] += acc;
  }
}

// n experts' blocks of one part from the stored layout (src, experts ss
// bytes apart, `blocks` blocks of kind `kind` each) into the chunk layout
// (dst, ds apart): a thread a block.
static __global__ void gc_repack_kernel(int kind, const uint8_t* __restrict__ src, size_t ss, uint8_t* __restrict__ dst,
                                        size_t ds, size_t blocks, int n) {
  const size_t bs = size_t(gguf_block_bytes(kind)), bd = size_t(gguf_block_bytes(gguf_c32_kind(kind)));
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < blocks * size_t(n); i += size_t(gridDim.x) * blockDim.x) {
    const size_t e = i / blocks, b = i % blocks;
    gguf_c32_block(kind, src + e * ss + b * bs, dst + e * ds + b * bd);
  }
}

// ------------------------------------------------------------------ host side

// The chunk layout (cg, cd; bytes per expert gu_bytes, dn_bytes, parts on
// 16-byte boundaries) of experts stored as gg (gate rows, then up rows)
// and gd (down rows) with H and I columns; false where a part's kind has
// none or rows are not whole blocks.
inline bool gc_expert_layout(const GMat& gg, const GMat& gd, int H, int I, GMat& cg, GMat& cd, size_t& gu_bytes,
                             size_t& dn_bytes) {
  if (H % 256 || I % 256 || gg.n < 1 || gd.n < 1) return false;
  auto lay = [](const GMat& from, int cols, GMat& to, size_t& bytes) {
    to = from;
    bytes = 0;
    for (int i = 0; i < to.n; ++i) {
      to.kind[i] = gguf_c32_kind(from.kind[i]);
      if (to.kind[i] < 0) return false;
      to.off[i] = bytes;
      bytes += (size_t(to.row0[i + 1] - to.row0[i]) * gguf_row_bytes(to.kind[i], cols) + 15) / 16 * 16;
    }
    return true;
  };
  return lay(gg, H, cg, gu_bytes) && lay(gd, I, cd, dn_bytes);
}

// A device buffer the uploads below reuse (grown as needed, freed with it).
struct GcScratch {
  void* p = nullptr;
  size_t n = 0;
  uint8_t* get(size_t bytes) {
    if (bytes > n) {
      if (p) CK(cudaFree(p));
      CK(cudaMalloc(&p, bytes));
      n = bytes;
    }
    return static_cast<uint8_t*>(p);
  }
  ~GcScratch() {
    if (p) cudaFree(p);
  }
};

// n experts in device memory (src, src_stride bytes apart) stored as
// `from` (rows of `cols` columns) rearranged into the chunk layout `to`
// (dst, dst_stride apart), on the default stream.
inline void gc_repack_experts(const uint8_t* src, size_t src_stride, const GMat& from, uint8_t* dst, size_t dst_stride,
                              const GMat& to, int cols, int n) {
  for (int i = 0; i < from.n; ++i) {
    const size_t blocks = size_t(from.row0[i + 1] - from.row0[i]) * size_t(cols / 256);
    const int grid = int(std::min<size_t>((blocks * size_t(n) + 255) / 256, 8192));
    gc_repack_kernel<<<grid, 256>>>(from.kind[i], src + from.off[i], src_stride, dst + to.off[i], dst_stride, blocks, n);
    CK(cudaGetLastError());
  }
}

// n experts stored as `from` in host memory (src, src_stride bytes apart;
// rows of `cols` columns) to the device in the chunk layout `to` (dst,
// dst_stride apart): the stored bytes go through a device scratch and are
// rearranged there, complete on return (the decode step's stream does not
// wait for the default stream).
inline void gc_upload_experts(const uint8_t* src, size_t src_stride, const GMat& from, uint8_t* dst, size_t dst_stride,
                              const GMat& to, int cols, int n, GcScratch& scratch) {
  uint8_t* s = scratch.get(src_stride * size_t(n));
  CK(cudaMemcpy(s, src, src_stride * size_t(n), cudaMemcpyHostToDevice));
  gc_repack_experts(s, src_stride, from, dst, dst_stride, to, cols, n);
  CK(cudaDeviceSynchronize());
}

// The shared expert stored on the device as s_gu (parts sgu) and s_down
// (sdn) copied into the routed experts' chunk layout (cg, cd; where
// gc_shared_joins holds) at gu and dn, complete on return.
inline void gc_copy_shared(const void* s_gu, const GMat& sgu, const void* s_down, const GMat& sdn, void* gu, void* dn,
                           const GMat& cg, const GMat& cd, int H, int I) {
  gc_repack_experts(static_cast<const uint8_t*>(s_gu), 0, sgu, static_cast<uint8_t*>(gu), 0, cg, H, 1);
  gc_repack_experts(static_cast<const uint8_t*>(s_down), 0, sdn, static_cast<uint8_t*>(dn), 0, cd, I, 1);
  CK(cudaDeviceSynchronize());
}

// Whether the shared expert (stored as ge.sgu, ge.sdn; Is columns of
// down) can be read as one more routed slot once in the chunk layout: its
// parts of the routed experts' stored kinds (ge.gu, ge.dn, before the
// chunk layout), Is == I.
inline bool gc_shared_joins(const GExperts& ge, int I, int Is) {
  if (Is != I || ge.sgu.n != 2 || ge.sdn.n != 1 || ge.gu.n != 2 || ge.dn.n != 1) return false;
  return ge.sgu.kind[0] == ge.gu.kind[0] && ge.sgu.kind[1] == ge.gu.kind[1] && ge.sdn.kind[0] == ge.dn.kind[0] &&
         ge.sgu.row0[1] == ge.gu.row0[1];
}

// Whether a layer's routed experts (ge.gu, ge.dn) are in the chunk layout
// and these kernels take the layer: k routed slots (ptr[32]), x and the
// slots' h in shared memory (smem: the opt-in limit; one slot more for a
// shared expert in the chunk layout), rows of whole blocks.
inline size_t gc_gate_up_smem(int H) { return size_t(H) * 4 * 2 + size_t(H / 8) * 4; }
inline size_t gc_down_smem(int slots, int I) { return size_t(slots) * (size_t(I) * 4 + size_t(I / 8) * 4); }
inline bool gc_experts_take(const GExperts& ge, int H, int I, int k, size_t smem) {
  if (ge.gu.n != 2 || ge.dn.n != 1 || k < 1 || k > 32 || H % 256 || I % 256) return false;
  for (int kind : {ge.gu.kind[0], ge.gu.kind[1], ge.dn.kind[0]})
    if (kind != GQ_Q4_K_C32 && kind != GQ_Q6_K_C32) return false;
  return gc_gate_up_smem(H) <= smem && gc_down_smem(k + 1, I) <= smem;
}

// Every instance of the two kernels may take `bytes` of dynamic shared memory.
inline void gc_allow_smem(int bytes) {
  auto allow = [&](auto kern) { CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)); };
  auto both = [&](auto sc) {
    constexpr bool SC = decltype(sc)::value;
    allow(gc_gate_up_kernel<-1, SC>);
    allow(gc_gate_up_kernel<GQ_Q4_K_C32, SC>);
    allow(gc_gate_up_kernel<GQ_Q6_K_C32, SC>);
    allow(gc_down_kernel<GQ_Q4_K_C32, SC, kGcLoads>);
    allow(gc_down_kernel<GQ_Q6_K_C32, SC, kGcLoads>);
    allow(gc_down_kernel<GQ_Q4_K_C32, SC, kGcLoads + 1>);
    allow(gc_down_kernel<GQ_Q6_K_C32, SC, kGcLoads + 1>);
  };
  both(std::false_type{});
  both(std::true_type{});
}

// The two kernels of a layer (gate_up, then down); after() runs after each
// launch (the decode step's profile marks). s_gu_chunks / s_down_chunks:
// the shared expert's copy in the routed experts' chunk layout
// (gc_copy_shared, where gc_shared_joins), read as one more routed slot in
// place of a.s_gu / a.s_down with the routed experts' parts; null: its
// stored rows (ge.sgu / ge.sdn).
template <typename After>
void gc_experts_launch(Launcher& l, MoeArgs a, GExperts ge, int slots, const void* s_gu_chunks,
                       const void* s_down_chunks, After after) {
  const bool sc = s_gu_chunks && a.has_shared;
  if (sc) a.s_gu = s_gu_chunks, a.s_down = s_down_chunks, ge.sgu = ge.gu, ge.sdn = ge.dn;
  const int ks = a.k + (sc ? 1 : 0);
  const size_t s1 = gc_gate_up_smem(a.H), s2 = gc_down_smem(ks, a.I);
  auto up = [&](auto kern) {
    const int resident = l.per_sm(reinterpret_cast<const void*>(kern), s1) * l.prop.multiProcessorCount;
    const dim3 g1(std::max(1, std::min((a.maxI + kWarps - 1) / kWarps, resident / slots)), slots);
    l.go(kern, g1, kThreads, s1, a, ge);
  };
  auto dn = [&](auto kern) {
    const int blocks = std::min((a.H + kWarps - 1) / kWarps,
                                l.per_sm(reinterpret_cast<const void*>(kern), s2) * l.prop.multiProcessorCount);
    l.go(kern, blocks, kThreads, s2, a, ge);
  };
  auto pair = [&](auto scv) {
    constexpr bool SC = decltype(scv)::value;
    const int kg = ge.gu.kind[0] == ge.gu.kind[1] ? ge.gu.kind[0] : -1;
    if (kg == GQ_Q4_K_C32) up(gc_gate_up_kernel<GQ_Q4_K_C32, SC>);
    else if (kg == GQ_Q6_K_C32) up(gc_gate_up_kernel<GQ_Q6_K_C32, SC>);
    else up(gc_gate_up_kernel<-1, SC>);
    after();
    // down: a row's chunks all in flight at once where one more a lane
    // holds them (the 35B's 9 slots of 16: 144; +1.8% tokens/s against
    // two rounds of 4, 8 a lane +0.8%: bench/NOTES-cuda.md, session 16).
    const bool one_round = ks * (a.I / 32) <= 32 * (kGcLoads + 1);
    auto dk = [&](auto kdv) {
      constexpr int KD = decltype(kdv)::value;
      if (one_round) dn(gc_down_kernel<KD, SC, kGcLoads + 1>);
      else dn(gc_down_kernel<KD, SC, kGcLoads>);
    };
    if (ge.dn.kind[0] == GQ_Q4_K_C32) dk(std::integral_constant<int, GQ_Q4_K_C32>{});
    else dk(std::integral_constant<int, GQ_Q6_K_C32>{});  // gc_experts_take admits no other kind
    after();
  };
  if (sc) pair(std::true_type{});
  else pair(std::false_type{});
}

}  // namespace flashmoe::cuda
