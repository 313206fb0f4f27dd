// The routed experts of an FP8 layer at decode (one token): gate_up and down
// with whole rows per warp, every code a warp needs copied into shared memory
// by cp.async at once, so that a kernel is one memory round trip per warp.
//
// Why (bench/NOTES-cuda.md, "FP8 routed experts: whole rows, one round
// trip"): the tensor-core tiles (fp8_experts.cuh's mma kernels) made each
// warp split x into f16 halves, read 64-byte pieces of 16 rows and sum its
// tiles through shared memory with two barriers per tile; the rows kernels
// of session 12 kept their codes in registers (2 rows of 2 KB at most per
// warp) and lost 19%. Here registers hold no codes: a warp of gate_up copies
// its 2 h rows' gate and up rows (4 x H bytes, 8 KB at H = 2,048) into its
// own slots of shared memory, a warp of down its x row's codes of every
// slot (k + 1 rows of I bytes), all before the math, and three (gate_up) or
// four (down) blocks of 8 warps fit on an SM: at the 35B shape the whole
// launch's codes are in flight at once (gate_up 18.9 MB over 288 blocks,
// down 9.4 MB over 256).
//
// Layout: a row's codes go in 16-byte chunks, chunk c = t 32 + lane (t < H /
// 512 "steps"), so a warp's copy of one step of one row is 512 contiguous
// bytes and each lane reads back only the chunks it copied (cp.async.wait_group
// per step, no barrier). A chunk's 16 codes lie in one scale block (block
// widths a multiple of 16); x (gate_up) and each slot's h (down) are staged
// chunk-major in shared memory (float4 q of chunk c at ((t 4 + q) 32 + lane)),
// so a warp's float4 reads hit consecutive words; each x float4 serves all
// the warp's rows. Codes are widened exactly (e4m3 -> f16 -> fp32) and
// multiplied in fp32; a chunk's sum times its block scale goes to the row.
//
// Where they apply (f8x_experts_take): H, I and Is multiples of 512 with at
// most 8 steps a row, block widths a multiple of 16, the shared expert FP8 or
// absent, and the experts picked before gate_up (the folded router's
// preselection or a top-k kernel; not gate_up's own pick, whose pointers
// down could not read before its wait).
#pragma once
#include "backend/cuda/fp8_experts.cuh"
#include "backend/cuda/fp8_rows.cuh"

namespace flashmoe::cuda {

constexpr int kF8XCols = 512;    // columns of one step of a row (a 16-byte chunk per lane)
constexpr int kF8XGuRows = 2;    // gate_up: h rows a warp takes (their gate and up rows)
constexpr int kF8XDnRows = 1;    // down: x rows a warp takes
constexpr int kF8XGuBlocks = 4;  // blocks per SM the kernels' registers are bounded for
constexpr int kF8XDnBlocks = 4;

// A 16-byte and a 4-byte asynchronous copy global -> shared (the scales
// travel with the codes, so no register waits for either).
__device__ __forceinline__ void f8x_cp4(float* dst, const float* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(src) : "memory");
}

// A warp's shared memory in gate_up: its 2 R rows of codes, then their
// block scales ([row][block]).
__host__ __device__ inline size_t f8x_gate_up_warp(int H, int group, int R = kF8XGuRows) {
  return size_t(2 * R) * H + (size_t(2 * R) * ((H + group - 1) / group) * 4 + 15) / 16 * 16;
}
// gate_up's: x chunk-major, then each warp's.
inline size_t f8x_gate_up_smem(int H, int group, int s_group, int R = kF8XGuRows) {
  return size_t(H) * 4 + size_t(kWarps) * std::max(f8x_gate_up_warp(H, group, R), f8x_gate_up_warp(H, s_group, R));
}
// A row's in down: its codes of every slot, then their block scales
// ([slot][block]).
__host__ __device__ inline size_t f8x_down_warp(int k, int I, int Is, int group, int s_group) {
  const size_t nsc = size_t(k) * ((I + group - 1) / group) + (Is ? (Is + s_group - 1) / s_group : 0);
  return size_t(k) * I + Is + (nsc * 4 + 15) / 16 * 16;
}
// down's: each slot's h chunk-major (the widest slot's length each), then
// each warp's.
inline size_t f8x_down_smem(int k, int I, int Is, int group, int s_group, int DR = kF8XDnRows) {
  const int slots = k + (Is ? 1 : 0), widest = std::max(I, Is);
  return size_t(slots) * widest * 4 + size_t(kWarps) * DR * f8x_down_warp(k, I, Is, group, s_group);
}

// Whether these kernels take a layer's experts (a: the launch's arguments,
// the shared expert FP8 where f8_shared; optin: shared memory a block may use).
inline bool f8x_experts_take(const MoeArgs& a, const QExpert& q, bool f8_shared, size_t optin) {
  const bool pick = a.logits && !a.presel;
  if (pick || a.pf_slot || a.k < 1 || a.k + a.has_shared > 32 || (a.has_shared && !f8_shared)) return false;
  if (a.H % kF8XCols || a.I % kF8XCols || q.group < 16 || q.group % 16 || q.block_rows % kF8XGuRows) return false;
  if (a.has_shared && (a.Is % kF8XCols || a.s_group < 16 || a.s_group % 16)) return false;
  const int Is = a.has_shared ? a.Is : 0;
  const int sg = a.has_shared ? a.s_group : q.group;
  return f8x_gate_up_smem(a.H, q.group, sg) <= optin && f8x_down_smem(a.k, a.I, Is, q.group, sg) <= optin;
}

// d + the 16 codes of v times x4[0..3] (16 consecutive x), widened exactly.
__device__ __forceinline__ float f8x_dot16(const uint4& v, const float4 (&x4)[4], float d) {
  d = f8_dot4(v.x, x4[0], d);
  d = f8_dot4(v.y, x4[1], d);
  d = f8_dot4(v.z, x4[2], d);
  return f8_dot4(v.w, x4[3], d);
}

// A float vector of `len` (a multiple of 512) into shared memory chunk-major,
// times r (1 + nw) where nw is given (the zero-centred RMS norm's weight);
// the block's threads share the copy (no barrier here).
__device__ __forceinline__ void f8x_stage(const float* __restrict__ v, const float* __restrict__ nw, float r, int len,
                                          float4* dst) {
  const float4* v4 = reinterpret_cast<const float4*>(v);
  for (int s = threadIdx.x; s < len / 4; s += blockDim.x) {
    const int l = s % 32, q = (s / 32) % 4, t = s / 128;
    const int c = (t * 32 + l) * 16 + 4 * q;
    float4 x = v4[c / 4];
    if (nw)  // four loads: a norm weight vector need not be 16-byte aligned
      x = make_float4(x.x * r * (1.f + nw[c]), x.y * r * (1.f + nw[c + 1]), x.z * r * (1.f + nw[c + 2]),
                      x.w * r * (1.f + nw[c + 3]));
    dst[s] = x;
  }
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn), blockIdx.y = slot j (the
// shared expert is slot k), a warp per kF8XGuRows rows of h (grid-stride).
// Block (0,0) computes the routing weights where the experts were
// preselected (MoeArgs::presel), as the other gate_up kernels.
template <int R = kF8XGuRows>
__global__ void __launch_bounds__(kThreads, kF8XGuBlocks) gate_up_fp8_smem_kernel(MoeArgs a, QExpert q) {
  constexpr int NR = 2 * R;
  extern __shared__ __align__(16) uint4 smx[];  // f8x_gate_up_smem
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I, H = a.H, steps = H / kF8XCols;
  const int group = shared ? a.s_group : q.group, nbc = (H + group - 1) / group;
  const size_t wr = f8x_gate_up_warp(H, q.group, R), ws = a.has_shared ? f8x_gate_up_warp(H, a.s_group, R) : 0;
  const size_t per_warp = wr > ws ? wr : ws;
  float4* xs4 = reinterpret_cast<float4*>(smx);
  uint4* buf = smx + H / 4 + warp * per_warp / 16;          // codes [row i][step t][lane]
  const float* sbuf = reinterpret_cast<const float*>(buf + NR * steps * 32);  // scales [row i][block]
  const uint8_t* B = nullptr;
  // Row i of the warp's rows r0 .. (gate rows r0 + i for i < R, up rows r0 +
  // i - R after): its codes and its block scales.
  auto row = [&](int r0, int i, const uint8_t*& w, const float*& sc) {
    const int r = min(r0 + i % R, I - 1);  // rows past I read row I - 1 (their sums are dropped)
    if (shared) {
      const int rr = i < R ? r : I + r;
      w = static_cast<const uint8_t*>(a.s_gu) + size_t(rr) * H;
      sc = a.s_gu_sc + size_t(rr) * nbc;
    } else {
      w = B + (i < R ? 0 : q.up_w) + size_t(r) * H;
      sc = reinterpret_cast<const float*>(B + (i < R ? q.gate_s : q.up_s)) + size_t(r / q.block_rows) * nbc;
    }
  };
  // The rows' codes and scales into the warp's slots: the scales with
  // step 0's codes, then a copy group per step.
  auto issue = [&](int r0) {
    const float* sc;
    const uint8_t* w[NR];
    for (int e = lane; e < NR * nbc; e += 32) {
      row(r0, e / nbc, w[0], sc);
      f8x_cp4(const_cast<float*>(sbuf) + e, sc + e % nbc);
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) row(r0, i, w[i], sc);
    for (int t = 0; t < steps; ++t) {
#pragma unroll
      for (int i = 0; i < NR; ++i) f8_cp16(buf + (i * steps + t) * 32 + lane, w[i] + (t * 32 + lane) * 16);
      f8_cp_commit();
    }
  };
  const int first = (blockIdx.x * kWarps + warp) * R, stride = gridDim.x * kWarps * R;
  if (shared && first < I) issue(first);  // the shared expert's rows are known before the wait
  pdl_wait();
  pdl_trigger();
  if (!shared) {
    B = static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
    if (first < I) issue(first);
  }
  // x normed (each warp sums the squares itself: no block reduction).
  float rn = 1.f;
  if (a.norm_w) {
    const float4* x4 = reinterpret_cast<const float4*>(a.x);
    float ss = 0.f;
    for (int i = lane; i < H / 4; i += 32) {
      const float4 v = x4[i];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    rn = 1.0f / sqrtf(warp_sum(ss) / float(H) + a.eps);
  }
  f8x_stage(a.x, a.norm_w, rn, H, xs4);
  __syncthreads();
  if (a.presel && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
    topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rn : 1.0f, a.w_out);
  for (int r0 = first; r0 < I; r0 += stride) {
    if (r0 != first) issue(r0);
    float acc[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.f;
    for (int t = 0; t < steps; ++t) {
      f8_cp_wait(min(7, steps - 1 - t));  // step t's group landed (later ones may still fly)
      if (t == 0) __syncwarp();           // the scales were copied by other lanes
      float4 xv[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) xv[p] = xs4[(t * 4 + p) * 32 + lane];
      const int b = (t * 32 + lane) * 16 / group;
#pragma unroll
      for (int i = 0; i < NR; ++i)
        acc[i] = fmaf(sbuf[i * nbc + b], f8x_dot16(buf[(i * steps + t) * 32 + lane], xv, 0.f), acc[i]);
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = warp_sum(acc[i]);
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (r0 + i < I) a.hb[j * a.maxI + r0 + i] = siluf_(acc[i]) * acc[R + i];
    __syncwarp();  // every lane read its slots before they are copied over
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j over the routed slots and the shared
// expert (slot k), a warp per DR rows of x (grid-stride): the rows' codes of
// every slot copied first (the scales with slot 0's, then a copy group per
// slot), then h staged.
template <int DR = kF8XDnRows>
__global__ void __launch_bounds__(kThreads, kF8XDnBlocks) down_fp8_smem_kernel(MoeArgs a, QExpert q) {
  extern __shared__ __align__(16) uint4 smx[];  // f8x_down_smem
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k = a.k, ns = k + a.has_shared;
  const int Is = a.has_shared ? a.Is : 0, widest = max(a.I, Is), sI = a.I / kF8XCols;
  const int sg = a.has_shared ? a.s_group : q.group;
  const int nbcI = (a.I + q.group - 1) / q.group, nbcS = Is ? (Is + sg - 1) / sg : 0;
  const int total = k * sI + Is / kF8XCols, nsc = k * nbcI + nbcS;  // steps and scales of one row
  const size_t per_row = f8x_down_warp(k, a.I, Is, q.group, sg) / 16;  // a row's codes, then its scales
  float4* hs4 = reinterpret_cast<float4*>(smx);
  uint4* buf = smx + size_t(ns) * widest / 4 + warp * DR * per_row;  // row d: [step][lane], then [slot][block]
  auto codes = [&](int d) { return buf + d * per_row; };
  auto scales = [&](int d) { return reinterpret_cast<float*>(buf + d * per_row + total * 32); };
  // This lane's pointer of routed slot `lane`, read before the wait: the
  // experts were picked before gate_up (f8x_experts_take), whose wait saw them.
  const uint8_t* mine =
      lane < k ? static_cast<const uint8_t*>(a.sel ? a.sel[k + lane] : a.down_tab[a.ids[lane]]) : nullptr;
  auto slot_ptr = [&](int s) {
    return reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(mine), s));
  };
  // Rows r0 .. r0 + DR - 1 (rows past H read row H - 1, dropped).
  auto issue = [&](int r0) {
    for (int base = 0; base < nsc; base += 32) {  // the scales first (in slot 0's group)
      const int e = base + lane;
      const uint8_t* D = slot_ptr(min(e < k * nbcI ? e / nbcI : k - 1, k - 1));
#pragma unroll
      for (int d = 0; d < DR; ++d) {
        const int r = min(r0 + d, a.H - 1);
        if (e < k * nbcI)
          f8x_cp4(scales(d) + e, reinterpret_cast<const float*>(D + q.dn_s) + size_t(r / q.block_rows) * nbcI + e % nbcI);
        else if (e < nsc)
          f8x_cp4(scales(d) + e, a.s_down_sc + size_t(r) * nbcS + (e - k * nbcI));
      }
    }
    int u = 0;
    for (int s = 0; s < ns; ++s) {
      const uint8_t* D = s < k ? slot_ptr(s) : static_cast<const uint8_t*>(a.s_down);
      const int len = s < k ? a.I : Is, n = len / kF8XCols;
      for (int t = 0; t < n; ++t, ++u)
#pragma unroll
        for (int d = 0; d < DR; ++d)
          f8_cp16(codes(d) + u * 32 + lane, D + size_t(min(r0 + d, a.H - 1)) * len + (t * 32 + lane) * 16);
      f8_cp_commit();  // a group per slot
    }
  };
  const int first = (blockIdx.x * kWarps + warp) * DR, stride = gridDim.x * kWarps * DR;
  if (first < a.H) issue(first);
  pdl_wait();
  pdl_trigger();
  const float wl = lane < ns ? a.w[lane] : 0.f;
  for (int s = 0; s < ns; ++s) f8x_stage(a.hb + s * a.maxI, nullptr, 1.f, s < k ? a.I : Is, hs4 + s * (widest / 4));
  __syncthreads();
  for (int r0 = first; r0 < a.H; r0 += stride) {
    if (r0 != first) issue(r0);
    float acc[DR];
#pragma unroll
    for (int d = 0; d < DR; ++d) acc[d] = 0.f;
    int u = 0;
    for (int s = 0; s < ns; ++s) {
      f8_cp_wait(min(7, ns - 1 - s));  // slot s's group landed (later ones may still fly)
      if (s == 0) __syncwarp();        // the scales were copied by other lanes
      const bool routed = s < k;
      const int n = (routed ? a.I : Is) / kF8XCols, group = routed ? q.group : sg, so = routed ? s * nbcI : k * nbcI;
      const float4* h4 = hs4 + s * (widest / 4);
      float dd[DR];
#pragma unroll
      for (int d = 0; d < DR; ++d) dd[d] = 0.f;
      for (int t = 0; t < n; ++t, ++u) {
        float4 hv[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) hv[p] = h4[(t * 4 + p) * 32 + lane];
        const int b = so + (t * 32 + lane) * 16 / group;
#pragma unroll
        for (int d = 0; d < DR; ++d) dd[d] = fmaf(scales(d)[b], f8x_dot16(codes(d)[u * 32 + lane], hv, 0.f), dd[d]);
      }
      const float ws = __shfl_sync(0xffffffffu, wl, s);
#pragma unroll
      for (int d = 0; d < DR; ++d) acc[d] = fmaf(ws, dd[d], acc[d]);
    }
#pragma unroll
    for (int d = 0; d < DR; ++d) acc[d] = warp_sum(acc[d]);
    if (lane == 0)
#pragma unroll
      for (int d = 0; d < DR; ++d)
        if (r0 + d < a.H) a.x[r0 + d] += acc[d];
    __syncwarp();  // every lane read its slots before they are copied over
  }
}

// Rows a warp of matvec_fp8_smem_kernel takes: 8 KB of codes at most (4
// rows of 2,048 columns), at least one row.
__host__ __device__ inline int f8x_matvec_rows(int cols) { return cols <= 2048 ? 4 : cols <= 4096 ? 2 : 1; }
// Its shared memory: x chunk-major, then each warp's R rows of codes and
// their scales ([row][block]).
inline size_t f8x_matvec_smem(int cols, int group) {
  const int R = f8x_matvec_rows(cols);
  return size_t(cols) * 4 + size_t(kWarps) * (size_t(R) * cols + (size_t(R) * ((cols + group - 1) / group) * 4 + 15) / 16 * 16);
}
// Whether it takes a DT_FP8 matrix of `cols` columns in blocks `group` wide.
inline bool f8x_matvec_takes(int cols, int group, size_t optin) {
  return cols > 0 && cols % kF8XCols == 0 && group >= 16 && group % 16 == 0 && f8x_matvec_smem(cols, group) <= optin;
}

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null) for a DT_FP8 W
// (codes [rows][cols], per-row block scales S [rows][nbc]): a warp per R =
// f8x_matvec_rows(cols) rows (grid-stride), their codes and scales copied
// into shared memory before the PDL wait (the weights do not depend on the
// kernel before), a copy group per step. xcopy: as matvec_kernel's.
template <int R>
__global__ void __launch_bounds__(kThreads, kF8XGuBlocks)
    matvec_fp8_smem_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S, int group, int rows, int cols,
                           const float* __restrict__ x, const float* __restrict__ nw, float eps, float* __restrict__ y,
                           int accumulate, float* __restrict__ xcopy) {
  extern __shared__ __align__(16) uint4 smx[];  // f8x_matvec_smem
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, steps = cols / kF8XCols, nbc = (cols + group - 1) / group;
  const size_t per_warp = (size_t(R) * cols + (size_t(R) * nbc * 4 + 15) / 16 * 16) / 16;
  float4* xs4 = reinterpret_cast<float4*>(smx);
  uint4* buf = smx + cols / 4 + warp * per_warp;                        // codes [row i][step t][lane]
  float* sbuf = reinterpret_cast<float*>(buf + R * steps * 32);         // scales [row i][block]
  auto issue = [&](int r0) {
    for (int e = lane; e < R * nbc; e += 32) f8x_cp4(sbuf + e, S + size_t(min(r0 + e / nbc, rows - 1)) * nbc + e % nbc);
    for (int t = 0; t < steps; ++t) {
#pragma unroll
      for (int i = 0; i < R; ++i)
        f8_cp16(buf + (i * steps + t) * 32 + lane, W + size_t(min(r0 + i, rows - 1)) * cols + (t * 32 + lane) * 16);
      f8_cp_commit();
    }
  };
  const int first = (blockIdx.x * kWarps + warp) * R, stride = gridDim.x * kWarps * R;
  if (first < rows) issue(first);
  pdl_wait();
  pdl_trigger();
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  float rn = 1.f;
  if (nw) {  // each warp sums the squares itself: no block reduction
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float ss = 0.f;
    for (int i = lane; i < cols / 4; i += 32) {
      const float4 v = x4[i];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    rn = 1.0f / sqrtf(warp_sum(ss) / float(cols) + eps);
  }
  f8x_stage(x, nw, rn, cols, xs4);
  __syncthreads();
  for (int r0 = first; r0 < rows; r0 += stride) {
    if (r0 != first) issue(r0);
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
    for (int t = 0; t < steps; ++t) {
      f8_cp_wait(min(7, steps - 1 - t));  // step t's group landed
      if (t == 0) __syncwarp();           // the scales were copied by other lanes
      float4 xv[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) xv[p] = xs4[(t * 4 + p) * 32 + lane];
      const int b = (t * 32 + lane) * 16 / group;
#pragma unroll
      for (int i = 0; i < R; ++i)
        acc[i] = fmaf(sbuf[i * nbc + b], f8x_dot16(buf[(i * steps + t) * 32 + lane], xv, 0.f), acc[i]);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = warp_sum(acc[i]);
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = r0 + i;
        if (r < rows) y[r] = accumulate ? y[r] + acc[i] : acc[i];
      }
    __syncwarp();  // every lane read its slots before they are copied over
  }
}

// f(matvec_fp8_smem_kernel<R>) for R = f8x_matvec_rows(cols).
template <class F>
void with_f8x_matvec(int cols, const F& f) {
  switch (f8x_matvec_rows(cols)) {
    case 4: f(matvec_fp8_smem_kernel<4>); break;
    case 2: f(matvec_fp8_smem_kernel<2>); break;
    default: f(matvec_fp8_smem_kernel<1>);
  }
}

}  // namespace flashmoe::cuda
