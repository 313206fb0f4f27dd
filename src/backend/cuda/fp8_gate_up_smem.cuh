// The routed experts' gate_up for FP8 block experts at decode (one token):
// whole rows per warp, every code and block scale a warp needs copied into
// shared memory by cp.async before any math, so that the launch is one
// memory round trip per warp; down stays on the tensor-core kernel
// (fp8_experts.cuh, down_fp8_mma_kernel), which measured faster than the
// same layout for down.
//
// Why (bench/NOTES-cuda.md, "FP8 decode: gate_up by whole rows through
// shared memory"; bench/micro/fp8_experts_bench.cu): the
// tensor-core gate_up (gate_up_fp8_mma_kernel) makes each warp split x into
// f16 halves, read 64-byte pieces of 16 rows and sum its tiles through
// shared memory with two barriers per tile; the rows kernels of session 12
// kept their codes in registers (2 rows of 2 KB at most per warp) and lost
// 19%. Here registers hold no codes: a warp copies its kF8XGuRows (1) h
// row's gate and up rows (2 x H bytes, 4 KB at H = 2,048) into its own
// slots of shared memory, and three blocks of 8 warps fit on an SM (the
// register bound), so at the 35B shape 3,168 of the layer's 4,608 rows are
// in flight at once and the rest follow in the same warps. Measured apart,
// gate_up + down of a 35B layer: 25.2 us on the tensor cores, 20.4-22.1 us
// so with 1 or 2 rows a warp (a plain read of their 28.4 MB: 8.8 us); in
// the decode step 1 row a warp decodes 2.7% faster than 2 (session 14).
//
// Layout: a row's codes go in 16-byte chunks, chunk c = t 32 + lane (t < H /
// 512 "steps"), so a warp's copy of one step of one row is 512 contiguous
// bytes and each lane reads back only the chunks it copied (wait_group makes
// a thread's own copies visible to it); the block scales of the rows go in
// one per lane, read by every lane after a __syncwarp. A chunk's 16 codes
// lie in one scale block (block widths a multiple of 16). x is normed and
// staged chunk-major in shared memory (float4 q of chunk c at ((t 4 + q) 32
// + lane), fp8_rows.cuh's f8_rows_stage_x with 16 codes a lane), so a warp's
// float4 reads hit consecutive words and each x float4 serves all the warp's
// rows. Codes are widened exactly (e4m3 -> f16
// -> fp32) and multiplied in fp32; a chunk's sum times its block scale goes
// to the row.
//
// Where it applies (f8x_gate_up_takes): H and I (and an FP8 shared expert's
// Is) multiples of 512, block widths a multiple of 16, and the experts
// picked before gate_up (the folded router's preselection or a top-k
// kernel; gate_up's own pick is the tensor-core kernel's).
#pragma once
#include "backend/cuda/fp8_experts.cuh"
#include "backend/cuda/fp8_rows.cuh"
#include "backend/cuda/launch.cuh"

namespace flashmoe::cuda {

constexpr int kF8XCols = 512;    // columns of one step of a row (a 16-byte chunk per lane)
constexpr int kF8XGuRows = 1;    // h rows a warp takes (their gate and up rows)
constexpr int kF8XGuBlocks = 3;  // blocks per SM the registers are bounded for (80 a thread, no spills)

// A 4-byte asynchronous copy global -> shared (the block scales travel with
// the codes, cp_async16, so no register waits for either).
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
// Whether gate_up_fp8_smem_kernel takes a layer's experts (a: the launch's
// arguments, the shared expert FP8 where f8_shared; optin: shared memory a
// block may use).
inline bool f8x_gate_up_takes(const MoeArgs& a, const QExpert& q, bool f8_shared, size_t optin) {
  const bool pick = a.logits && !a.presel;
  if (pick || a.pf_slot || a.k < 1 || a.k + a.has_shared > 32 || (a.has_shared && !f8_shared)) return false;
  if (a.H % kF8XCols || a.I % kF8XCols || q.group < 16 || q.group % 16 || q.block_rows % kF8XGuRows) return false;
  if (a.has_shared && (a.Is % kF8XCols || a.s_group < 16 || a.s_group % 16)) return false;
  return f8x_gate_up_smem(a.H, q.group, a.has_shared ? a.s_group : q.group) <= optin;
}

// d + the 16 codes of v times x4[0..3] (16 consecutive x), widened exactly.
__device__ __forceinline__ float f8x_dot16(const uint4& v, const float4 (&x4)[4], float d) {
  d = f8_dot4(v.x, x4[0], d);
  d = f8_dot4(v.y, x4[1], d);
  d = f8_dot4(v.z, x4[2], d);
  return f8_dot4(v.w, x4[3], d);
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
  // The rows' codes and scales into the warp's slots, one copy group (one
  // wait for all measured faster than a group per step).
  auto issue = [&](int r0) {
    const float* sc;
    const uint8_t* w;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      row(r0, i, w, sc);
      for (int t = 0; t < steps; ++t) cp_async16(buf + (i * steps + t) * 32 + lane, w + (t * 32 + lane) * 16);
    }
    for (int e = lane; e < NR * nbc; e += 32) {
      row(r0, e / nbc, w, sc);
      f8x_cp4(const_cast<float*>(sbuf) + e, sc + e % nbc);
    }
    cp_async_commit();
  };
  const int first = (blockIdx.x * kWarps + warp) * R, stride = gridDim.x * kWarps * R;
  if (shared && first < I) issue(first);  // the shared expert's rows are known before the wait
  pdl_wait();
  pdl_trigger();
  if (!shared) {
    B = static_cast<const uint8_t*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
    if (first < I) issue(first);
  }
  const float rn = f8_rows_stage_x<16>(a.x, a.norm_w, a.eps, H, xs4);  // x normed, chunk-major
  if (a.presel && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
    topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rn : 1.0f, a.w_out);
  for (int r0 = first; r0 < I; r0 += stride) {
    if (r0 != first) issue(r0);
    f8_cp_wait(0);
    __syncwarp();  // the scales were copied by other lanes
    float acc[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.f;
    for (int t = 0; t < steps; ++t) {
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

// Launches gate_up_fp8_smem_kernel over `slots` slots (one resident wave;
// warps take more rows where the rows need more): the decode step's and
// the op check's launch.
inline void launch_gate_up_fp8_smem(Launcher& l, const MoeArgs& a, const QExpert& q, int slots) {
  const size_t smem = f8x_gate_up_smem(a.H, q.group, a.has_shared ? a.s_group : q.group);
  const void* fn = reinterpret_cast<const void*>(gate_up_fp8_smem_kernel<>);
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int rows = kWarps * kF8XGuRows, need = (a.maxI + rows - 1) / rows;
  const int fit = l.per_sm(fn, smem) * l.prop.multiProcessorCount / slots;
  l.go(gate_up_fp8_smem_kernel<>, dim3(std::max(1, std::min(need, fit)), slots), kThreads, smem, a, q);
}

}  // namespace flashmoe::cuda
