// The routed experts' products for FP8 block experts (Qwen's / DeepSeek's
// FP8 releases: one E4M3 code per weight, one fp32 scale per block of
// block_rows x group weights; device blocks as QExpert with fp8 set,
// device_model.cuh). The codes are read as stored, 16 per 16-byte load,
// widened in registers (Hopper's cvt.rn.f16x2.e4m3x2: exact, E4M3 fits in
// f16), multiplied against fp32 x; a chunk's 16 columns lie in one scale
// block (group is a multiple of 16), so its dot is scaled once. The same
// structure as quant_experts.cuh (x staged chunk-major, kF8Loads chunks in
// flight per lane); the shared expert (slot k) keeps its storage type TS,
// or is FP8 too (TS = F8Rows: a DMat's per-row scales, fp8_matvec.cuh).
#pragma once
#include "backend/cuda/fp8_matvec.cuh"
#include "backend/cuda/quant_experts.cuh"

namespace flashmoe::cuda {

// The shared expert's row r (cols wide) dotted with xs: in storage type TS,
// or FP8 with per-row scales (sc, group).
template <typename TS>
__device__ __forceinline__ float shared_row_dot(const void* W, const float* sc, int group, int r, const float* xs,
                                                int cols, int lane) {
  if constexpr (std::is_same_v<TS, F8Rows>) {
    const int nbc = (cols + group - 1) / group;
    return fp8_row_dot(static_cast<const uint8_t*>(W) + size_t(r) * cols, sc + size_t(r) * nbc, group, 0, xs, cols,
                       lane);
  } else {
    return row_dot<TS>(static_cast<const TS*>(W) + size_t(r) * cols, xs, cols, lane);
  }
}

// The unscaled dot of 16 codes (one 16-byte chunk) with x staged
// chunk-major (stage_chunks<8>: float4 i of the chunk at xq[i * stride]).
__device__ __forceinline__ float fp8_chunk_dot(const uint4& v, const float4* xq, int stride) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  float d = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = xq[i * stride];
    const float2 a = e4m3x2_to_float2(u[i]), b = e4m3x2_to_float2(u[i] >> 16);
    d = fmaf(a.x, x.x, d);
    d = fmaf(a.y, x.y, d);
    d = fmaf(b.x, x.z, d);
    d = fmaf(b.y, x.w, d);
  }
  return d;
}

// Row r of an FP8 block matrix inside an expert block B: its codes (cols
// bytes) and its block row's scales.
struct F8Row {
  const uint8_t* w;
  const float* s;
};
__device__ __forceinline__ F8Row f8row(const uint8_t* B, size_t w, size_t s, int cols, int nbc, int block_rows,
                                       int r) {
  return {B + w + size_t(r) * cols, reinterpret_cast<const float*>(B + s) + size_t(r / block_rows) * nbc};
}
// 16-byte chunks of codes each lane has in flight at once, as the q8
// kernels' kQLoads (8 measured slower on the 35B: bench/NOTES-cuda.md, FP8).
constexpr int kF8Loads = 4;
struct F8Loads {
  uint4 v[kF8Loads];
  float s[kF8Loads];
};

// One lane's chunk t in flight: codes and the chunk's block scale.
__device__ __forceinline__ void f8load(F8Loads& L, int t, const F8Row& R, int ch, int group) {
  L.v[t] = ld_stream(R.w + ch * 16);
  L.s[t] = __ldg(R.s + ch * 16 / group);
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j (as
// gate_up_q_kernel, including the fold's early pick: block (0,0) then
// computes the routing weights). With logits and no early pick, each routed
// block picks the experts itself from the router's logits (as
// gate_up_kernel: no top-k kernel between router and experts); block (0,0)
// publishes ids, weights and row pointers for down and does the counting.
template <typename TS>
__global__ void __launch_bounds__(kThreads) gate_up_fp8_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) float xs[];  // [H] x normed, [H] chunk-major, [H / 8] sums
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool pick = !shared && a.logits && !a.presel;  // uniform over the block
  if (pick && warp == 0) prefetch_tables(a.tsel, a.E);
  pdl_wait();
  pdl_trigger();
  const uint8_t* B =
      shared || pick ? nullptr : static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
  const int cpr = a.H / 16, nbc = (a.H + q.group - 1) / q.group;
  auto row = [&](int part, int r) {
    return part ? f8row(B, q.up_w, q.up_s, a.H, nbc, q.block_rows, r) : f8row(B, 0, q.gate_s, a.H, nbc, q.block_rows, r);
  };
  auto issue = [&](F8Loads& L, int r, int i0) {
#pragma unroll
    for (int t = 0; t < kF8Loads; ++t) {
      const int idx = i0 + 32 * t, part = idx >= cpr;
      if (idx < 2 * cpr) f8load(L, t, row(part, r), idx - part * cpr, q.group);
    }
  };
  F8Loads L;
  const int r_first = blockIdx.x * kWarps + warp;
  const bool early = !shared && !pick && r_first < I;
  if (early) issue(L, r_first, lane);  // in flight while x is normed and staged
  const float rx = load_x(a.x, a.norm_w, a.eps, a.H, xs);
  float4* xq = reinterpret_cast<float4*>(xs + a.H);
  float* s8 = xs + 2 * a.H;
  stage_chunks<8>(xs, a.H, xq, s8);
  __syncthreads();
  if (a.presel && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
    topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rx : 1.0f, a.w_out);
  if (pick) {
    __shared__ const void* chosen[64];
    __shared__ int cid[32];
    __shared__ float cw[33];
    const bool lead = blockIdx.x == 0 && blockIdx.y == 0;
    if (warp == 0) {
      ExpertSel to = a.tsel;
      to.out = chosen;
      TierCount tc = a.tc;
      if (!lead) tc.counts = nullptr;
      topk_warp(a.logits, a.E, a.k, a.norm_topk, a.has_shared, cid, cw, tc, to, a.folded ? rx : 1.0f);
      __syncwarp();
      if (lead) {
        if (lane < a.k) {
          a.ids_out[lane] = cid[lane];
          a.w_out[lane] = cw[lane];
          a.tsel.out[lane] = chosen[lane];
          a.tsel.out[a.k + lane] = chosen[a.k + lane];
        }
        if (lane == 0 && a.has_shared) a.w_out[a.k] = cw[a.k];
      }
    }
    __syncthreads();
    B = static_cast<const uint8_t*>(chosen[j]);
  }
  for (int r = r_first; r < I; r += gridDim.x * kWarps) {
    float g = 0.f, u = 0.f;
    if (shared) {
      g = shared_row_dot<TS>(a.s_gu, a.s_gu_sc, a.s_group, r, xs, a.H, lane);
      u = shared_row_dot<TS>(a.s_gu, a.s_gu_sc, a.s_group, I + r, xs, a.H, lane);
    } else {
      for (int i0 = lane; i0 < 2 * cpr; i0 += 32 * kF8Loads) {
        if (!early || r != r_first || i0 != lane) issue(L, r, i0);
#pragma unroll
        for (int t = 0; t < kF8Loads; ++t) {
          const int idx = i0 + 32 * t, part = idx >= cpr, ch = idx - part * cpr;
          if (idx < 2 * cpr) {
            const float d = L.s[t] * fp8_chunk_dot(L.v[t], xq + ch, cpr);
            if (part) u += d;
            else g += d;
          }
        }
      }
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) a.hb[j * a.maxI + r] = siluf_(g) * u;
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j, one warp per row (as down_q_kernel):
// the routed slots' h staged chunk-major, their chunks of the row spread
// over the lanes, then the shared expert's row.
template <typename TS>
__global__ void __launch_bounds__(kThreads) down_fp8_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) float4 hq[];  // [k][I / 4] each routed slot's h chunk-major, then [k][I / 8] sums
  __shared__ const uint8_t* ptr[32];
  __shared__ float wj[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k = a.k;
  pdl_wait();
  pdl_trigger();
  if (int(threadIdx.x) < k) ptr[threadIdx.x] = static_cast<const uint8_t*>(
      a.sel ? a.sel[k + threadIdx.x] : a.down_tab[a.ids[threadIdx.x]]);
  if (int(threadIdx.x) < k + (a.has_shared ? 1 : 0)) wj[threadIdx.x] = a.w[threadIdx.x];
  __syncthreads();
  const int cpr = a.I / 16, n = k * cpr, nbc = (a.I + q.group - 1) / q.group;
  auto issue = [&](F8Loads& L, int r, int i0) {
#pragma unroll
    for (int t = 0; t < kF8Loads; ++t) {
      const int idx = i0 + 32 * t, sl = idx / cpr;
      if (idx < n) f8load(L, t, f8row(ptr[sl], 0, q.dn_s, a.I, nbc, q.block_rows, r), idx - sl * cpr, q.group);
    }
  };
  F8Loads L;
  const int r_first = blockIdx.x * kWarps + warp;
  if (r_first < a.H) issue(L, r_first, lane);  // in flight while h is staged
  float* s8 = reinterpret_cast<float*>(hq + k * (a.I / 4));
  for (int j = 0; j < k; ++j) stage_chunks<8>(a.hb + j * a.maxI, a.I, hq + j * (a.I / 4), s8 + j * (a.I / 8));
  __syncthreads();
  for (int r = r_first; r < a.H; r += gridDim.x * kWarps) {
    float acc = 0.f;
    for (int i0 = lane; i0 < n; i0 += 32 * kF8Loads) {
      if (r != r_first || i0 != lane) issue(L, r, i0);
#pragma unroll
      for (int t = 0; t < kF8Loads; ++t) {
        const int idx = i0 + 32 * t, sl = idx / cpr, ch = idx - sl * cpr;
        if (idx < n) acc += wj[sl] * (L.s[t] * fp8_chunk_dot(L.v[t], hq + sl * (a.I / 4) + ch, cpr));
      }
    }
    if (a.has_shared)
      acc += wj[k] * shared_row_dot<TS>(a.s_down, a.s_down_sc, a.s_group, r, a.hb + k * a.maxI, a.Is, lane);
    acc = warp_sum(acc);
    if (lane == 0) a.x[r] += acc;
  }
}

}  // namespace flashmoe::cuda
