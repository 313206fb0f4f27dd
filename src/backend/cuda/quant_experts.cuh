// The routed experts' products for q8/q4 experts (packed models: group-wise
// affine quantisation, w = q * scale + bias per group of columns, the MLX
// layout of core/matrix.h; device blocks as QExpert in device_model.cuh).
// A group's dot is scale * (q . x) + bias * sum(x), so the codes are never
// widened to weights: 8 columns at a time, codes and x in registers. The
// shared expert (slot k) keeps its own storage type TS. The pick comes from
// the top-k kernel or the fold's early pick (presel); gate_up never picks.
// The batched prefill dequantises in its product kernel instead (gemm.cuh).
#pragma once
#include "backend/cuda/device_model.cuh"
#include "backend/cuda/experts.cuh"

namespace flashmoe::cuda {

// 16-byte chunks of codes each lane has in flight at once.
constexpr int kQLoads = 4;

// x staged in shared memory for the chunks. A lane's chunk covers 128 /
// BITS consecutive columns, so lanes reading x in place read 64 or 128
// bytes apart, the same banks (an 8-way conflict for q4, most of gate_up's
// time by ncu). Staged "chunk-major" instead: float4 i of chunk ch at
// xq[i * cpr + ch], so lanes on consecutive chunks read consecutive
// float4s; with the sums of x over each 8 columns (s8[k * cpr + ch], k:
// the 8-column piece of the chunk), which every row's bias term uses.
template <int BITS>
__device__ __forceinline__ void stage_chunks(const float* __restrict__ x, int cols, float4* xq, float* s8) {
  constexpr int P = 16 / BITS;  // 8-column pieces per chunk
  const int cpr = cols * BITS / 128;
  for (int p = threadIdx.x; p < cols / 8; p += blockDim.x) {
    const int k = p % P, ch = p / P;
    const float4 a = reinterpret_cast<const float4*>(x)[2 * p], b = reinterpret_cast<const float4*>(x)[2 * p + 1];
    xq[(2 * k) * cpr + ch] = a;
    xq[(2 * k + 1) * cpr + ch] = b;
    s8[k * cpr + ch] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
  }
}

// The dot of one 16-byte chunk of codes (128 / BITS columns, first column
// c of the row) with staged x (xq, s8 at the chunk; stride cpr): with one
// scale and bias for the whole chunk (one: the group is a multiple of the
// chunk) or, for small groups, each 8 columns with their own (sc, bi: the
// row's scales and biases).
template <int BITS>
__device__ __forceinline__ float qchunk_dot(const uint4& v, const float4* xq, const float* s8, int stride, int c,
                                            bool one, float s, float b, const __nv_bfloat16* sc,
                                            const __nv_bfloat16* bi, int group) {
  constexpr int P = 16 / BITS;
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  float acc = 0.f, dall = 0.f, xall = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const float4 x0 = xq[(2 * k) * stride], x1 = xq[(2 * k + 1) * stride];
    const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    float d = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t q;
      if constexpr (BITS == 8) q = (u[2 * k + i / 4] >> (8 * (i % 4))) & 0xffu;
      else q = (u[k] >> (4 * i)) & 0xfu;  // lowest nibble first
      d = fmaf(float(q), xv[i], d);
    }
    const float xs = s8[k * stride];
    if (one) {
      dall += d;
      xall += xs;
    } else {
      const int g = (c + 8 * k) / group;
      acc += __bfloat162float(__ldg(sc + g)) * d + __bfloat162float(__ldg(bi + g)) * xs;
    }
  }
  return one ? s * dall + b * xall : acc;
}

// The pieces of a quantised row (codes, scales, biases) in a block B.
struct QRow {
  const uint8_t* w;
  const __nv_bfloat16 *s, *b;
};
__device__ __forceinline__ QRow qrow(const uint8_t* B, size_t w, size_t s, size_t b, int row_bytes, int gpr, int r) {
  return {B + w + size_t(r) * row_bytes, reinterpret_cast<const __nv_bfloat16*>(B + s) + size_t(r) * gpr,
          reinterpret_cast<const __nv_bfloat16*>(B + b) + size_t(r) * gpr};
}

// One lane's kQLoads chunks in flight: codes, and (one) the group's scale and bias.
struct QLoads {
  uint4 v[kQLoads];
  float s[kQLoads], b[kQLoads];
};
template <int BITS>
__device__ __forceinline__ void qload(QLoads& L, int t, const QRow& R, int ch, bool one, int group) {
  constexpr int EPC = 128 / BITS;
  L.v[t] = ld_stream(R.w + ch * 16);
  if (one) {
    L.s[t] = __bfloat162float(__ldg(R.s + ch * EPC / group));
    L.b[t] = __bfloat162float(__ldg(R.b + ch * EPC / group));
  }
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j. A
// warp's row pair is 2 * cpr chunks; each lane has up to kQLoads of them in
// flight before any is used, the first ones issued before x is normed and
// staged. With the fold's early pick (presel), block (0,0) also computes
// the routing weights (as gate_up_kernel).
template <int BITS, typename TS>
__global__ void __launch_bounds__(kThreads) gate_up_q_kernel(MoeArgs a, QExpert q) {
  constexpr int EPC = 128 / BITS;
  extern __shared__ __align__(16) float xs[];  // [H] x normed, [H] chunk-major, [H / 8] sums
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  pdl_wait();
  pdl_trigger();
  if (a.pf_slot && !shared) wait_copied(a, j);
  const uint8_t* B = shared ? nullptr : static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
  const int cpr = q.gu_row / 16, gpr = a.H / q.group;
  const bool one = q.group % EPC == 0;
  // Row r of gate (part 0) or up (1).
  auto row = [&](int part, int r) {
    return part ? qrow(B, q.up_w, q.up_s, q.up_b, q.gu_row, gpr, r) : qrow(B, 0, q.gate_s, q.gate_b, q.gu_row, gpr, r);
  };
  auto issue = [&](QLoads& L, int r, int i0) {
#pragma unroll
    for (int t = 0; t < kQLoads; ++t) {
      const int idx = i0 + 32 * t, part = idx >= cpr;
      if (idx < 2 * cpr) qload<BITS>(L, t, row(part, r), idx - part * cpr, one, q.group);
    }
  };
  QLoads L;
  const int r_first = blockIdx.x * kWarps + warp;
  if (!shared && r_first < I) issue(L, r_first, lane);  // the first loads wait for nothing but the pick
  const float rx = load_x(a.x, a.norm_w, a.eps, a.H, xs);
  float4* xq = reinterpret_cast<float4*>(xs + a.H);
  float* s8 = xs + 2 * a.H;
  stage_chunks<BITS>(xs, a.H, xq, s8);
  __syncthreads();
  if (a.presel && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
    topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rx : 1.0f, a.w_out);
  const TS* S = static_cast<const TS*>(a.s_gu);
  for (int r = r_first; r < I; r += gridDim.x * kWarps) {
    float g = 0.f, u = 0.f;
    if (shared) {
      g = row_dot<TS>(S + size_t(r) * a.H, xs, a.H, lane);
      u = row_dot<TS>(S + size_t(I + r) * a.H, xs, a.H, lane);
    } else {
      for (int i0 = lane; i0 < 2 * cpr; i0 += 32 * kQLoads) {
        if (r != r_first || i0 != lane) issue(L, r, i0);
#pragma unroll
        for (int t = 0; t < kQLoads; ++t) {
          const int idx = i0 + 32 * t, part = idx >= cpr, ch = idx - part * cpr;
          if (idx < 2 * cpr) {
            const QRow R = row(part, r);
            const float d = qchunk_dot<BITS>(L.v[t], xq + ch, s8 + ch, cpr, ch * EPC, one, L.s[t], L.b[t], R.s, R.b,
                                             q.group);
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

// x[r] += sum_j w_j * down_j[r] . h_j, one warp per row: the routed slots'
// h staged in shared memory (stage_chunks), the routed slots' chunks of the
// row (k * cpr of them) spread over the lanes, kQLoads in flight per lane
// (the first ones issued before h is staged), each weighted by its slot's w
// as it is summed; then the shared expert's row. One warp sum per row.
template <int BITS, typename TS>
__global__ void __launch_bounds__(kThreads) down_q_kernel(MoeArgs a, QExpert q) {
  constexpr int EPC = 128 / BITS;
  extern __shared__ __align__(16) float4 hq[];  // [k][I / 4] each routed slot's h chunk-major, then [k][I / 8] sums
  __shared__ const uint8_t* ptr[32];
  __shared__ float wj[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k = a.k;
  pdl_wait();
  pdl_trigger();
  if (int(threadIdx.x) < k) {
    if (a.pf_slot) wait_copied_thread(a, threadIdx.x);  // the __syncthreads below publishes the wait
    ptr[threadIdx.x] = static_cast<const uint8_t*>(a.sel ? a.sel[k + threadIdx.x] : a.down_tab[a.ids[threadIdx.x]]);
  }
  if (int(threadIdx.x) < k + (a.has_shared ? 1 : 0)) wj[threadIdx.x] = a.w[threadIdx.x];
  __syncthreads();
  const int cpr = q.dn_row / 16, n = k * cpr, gpr = a.I / q.group;
  const bool one = q.group % EPC == 0;
  auto issue = [&](QLoads& L, int r, int i0) {
#pragma unroll
    for (int t = 0; t < kQLoads; ++t) {
      const int idx = i0 + 32 * t, sl = idx / cpr;
      if (idx < n) qload<BITS>(L, t, qrow(ptr[sl], 0, q.dn_s, q.dn_b, q.dn_row, gpr, r), idx - sl * cpr, one, q.group);
    }
  };
  QLoads L;
  const int r_first = blockIdx.x * kWarps + warp;
  if (r_first < a.H) issue(L, r_first, lane);  // in flight while h is staged
  float* s8 = reinterpret_cast<float*>(hq + k * (a.I / 4));
  for (int j = 0; j < k; ++j) stage_chunks<BITS>(a.hb + j * a.maxI, a.I, hq + j * (a.I / 4), s8 + j * (a.I / 8));
  __syncthreads();
  for (int r = r_first; r < a.H; r += gridDim.x * kWarps) {
    float acc = 0.f;
    for (int i0 = lane; i0 < n; i0 += 32 * kQLoads) {
      if (r != r_first || i0 != lane) issue(L, r, i0);
#pragma unroll
      for (int t = 0; t < kQLoads; ++t) {
        const int idx = i0 + 32 * t, sl = idx / cpr, ch = idx - sl * cpr;
        if (idx < n) {
          const QRow R = qrow(ptr[sl], 0, q.dn_s, q.dn_b, q.dn_row, gpr, r);
          acc += wj[sl] * qchunk_dot<BITS>(L.v[t], hq + sl * (a.I / 4) + ch, s8 + sl * (a.I / 8) + ch, cpr, ch * EPC,
                                           one, L.s[t], L.b[t], R.s, R.b, q.group);
        }
      }
    }
    if (a.has_shared)
      acc += wj[k] * row_dot<TS>(static_cast<const TS*>(a.s_down) + size_t(r) * a.Is, a.hb + k * a.maxI, a.Is, lane);
    acc = warp_sum(acc);
    if (lane == 0) a.x[r] += acc;
  }
}

}  // namespace flashmoe::cuda
