// The expert kernels of the decode step (bf16/f16/f32 experts; quantised
// ones: quant_experts.cuh): gate/up with SiLU for the chosen experts and the
// shared expert (or a dense MLP as one slot), then down, weighted and added
// to the residual.
#pragma once
#include "backend/cuda/host_prefetch.cuh"
#include "backend/cuda/router.cuh"

namespace flashmoe::cuda {

struct MoeArgs {
  const void* const* gu_tab;    // [E] routed expert e's gate/up rows [2I][H] (VRAM or pinned host)
  const void* const* down_tab;  // [E] routed expert e's down rows [H][I]
  const void* s_gu;    // shared / dense [2Is][H]
  const void* s_down;  // [H][Is]
  const float *s_gu_sc = nullptr, *s_down_sc = nullptr;  // FP8 shared expert (DT_FP8): per-row block scales
  int s_group = 0;                                       // and the block width
  const int* ids;      // [k]
  const void* const* sel;  // [2k] chosen experts' rows written by the top-k (null: look up ids in the tables)
  const float* w;      // [k (+1)]
  int k, I, Is, H, maxI, has_shared;
  int pf_rows;  // down: rows per warp prefetched before the wait
  const float* norm_w;
  float eps;
  float* x;   // residual stream [H] (input of gate_up, accumulated by down)
  float* hb;  // [k+1][maxI]
  // Top-k inside gate_up (logits non-null, presel 0): every routed block
  // picks the experts itself from the router's logits (a warp's work, done
  // by all blocks at once) instead of waiting for a top-k kernel; block (0,0)
  // publishes ids, weights and row pointers for down and does the counting.
  // With presel the pick was made before (outproj_router_kernel) and block
  // (0,0) only computes the weights.
  const float* logits;
  int E, norm_topk;
  int folded;  // logits are the folded router's, not yet divided by rms(x) (outproj_router_kernel)
  int presel;  // the experts were picked by outproj_router_kernel (ids, sel): only the weights are left
  int sel_ready;  // sel was final before gate_up started (presel): down may read its rows before its wait
  TierCount tc;
  ExpertSel tsel;  // tables; .out: where block (0,0) publishes the row pointers
  int* ids_out;
  float* w_out;
  // Host-tier experts by the copy engine, the expert kernels waiting for the
  // copies themselves (host_prefetch.cuh): routed slot j reads staging slot
  // pf_slot[j] (-1: not a copy) once pf_flag[that slot] == pf_seq. Null: no wait.
  const int* pf_slot = nullptr;
  const unsigned* pf_flag = nullptr;
  unsigned pf_seq = 0;
  unsigned* pf_stuck = nullptr;  // set when a wait passed its limit (PrefetchRest::stuck)
};

// The routed expert of slot j when a gate_up block picks the experts itself
// (MoeArgs::logits, no presel): warp 0 runs the top-k over the logits
// (times scale: 1 / rms(x) for folded ones); block (0,0) publishes ids,
// weights and row pointers for down and does the tier counting. Every thread
// of the block calls it (it ends with a barrier); returns slot j's gate/up rows.
__device__ __forceinline__ const void* pick_block_expert(const MoeArgs& a, int j, float scale) {
  __shared__ const void* chosen[64];
  __shared__ int cid[32];
  __shared__ float cw[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool lead = blockIdx.x == 0 && blockIdx.y == 0;
  if (warp == 0) {
    ExpertSel to = a.tsel;
    to.out = chosen;
    TierCount tc = a.tc;
    if (!lead) tc.counts = nullptr;
    topk_warp(a.logits, a.E, a.k, a.norm_topk, a.has_shared, cid, cw, tc, to, scale);
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
  return chosen[j];
}

// The copy of routed slot j's expert, when it reads one (MoeArgs::pf_slot),
// complete: one thread polls the flag the copy stream writes after it.
__device__ __forceinline__ void wait_copied_thread(const MoeArgs& a, int j) {
  const int p = a.pf_slot[j];
  if (p < 0) return;
  unsigned v;
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a.pf_flag + p) : "memory");
    if (v == a.pf_seq) break;
    __nanosleep(200);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > kCopyWaitLimitNs) {  // a copy that was never issued: say so, do not hang
      *reinterpret_cast<volatile unsigned*>(a.pf_stuck) = 1;
      __threadfence_system();
      break;
    }
  }
}
// The same for a whole block of slot j (uniform over the block).
__device__ __forceinline__ void wait_copied(const MoeArgs& a, int j) {
  if (threadIdx.x == 0) wait_copied_thread(a, j);
  __syncthreads();
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j.
template <typename T>
__global__ void __launch_bounds__(kThreads, 5) gate_up_kernel(MoeArgs a) {
  extern __shared__ __align__(16) float xs[];
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (shared)  // its rows are known before the wait
    for (int r = blockIdx.x * kWarps + warp; r < I; r += gridDim.x * kWarps) {
      warp_prefetch(static_cast<const T*>(a.s_gu) + size_t(r) * a.H, size_t(a.H) * sizeof(T), lane);
      warp_prefetch(static_cast<const T*>(a.s_gu) + size_t(I + r) * a.H, size_t(a.H) * sizeof(T), lane);
    }
  else if (a.logits && !a.presel && warp == 0)
    prefetch_tables(a.tsel, a.E);
  NormPre pre;
  norm_preload(a.norm_w, a.H, true, pre);
  pdl_wait();
  pdl_trigger();
  // x normed first: its scale 1/rms also turns folded router logits into logits.
  const float rx = load_x(a.x, a.norm_w, a.eps, a.H, xs, &pre);
  const T* W;
  if (shared) {
    W = static_cast<const T*>(a.s_gu);
  } else if (a.presel) {  // picked by outproj_router_kernel; block (0,0) adds the weights
    W = static_cast<const T*>(a.sel[j]);
    if (blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
      topk_weights(a.logits, a.E, a.k, a.norm_topk, a.has_shared, a.ids, a.folded ? rx : 1.0f, a.w_out);
  } else if (a.logits) {
    W = static_cast<const T*>(pick_block_expert(a, j, a.folded ? rx : 1.0f));
  } else {
    W = static_cast<const T*>(a.sel ? a.sel[j] : a.gu_tab[a.ids[j]]);
  }
  for (int r = blockIdx.x * kWarps + warp; r < I; r += gridDim.x * kWarps) {
    float gu[2];  // the gate and up rows' loads in flight together
    rows_dot<T, 2>(W + size_t(r) * a.H, size_t(I) * a.H, 2, xs, a.H, lane, gu);
    const float g = warp_sum(gu[0]), u = warp_sum(gu[1]);
    if (lane == 0) a.hb[j * a.maxI + r] = siluf_(g) * u;
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j. `split` warps share a row, each
// taking slots sub, sub+split, ...; partials summed in a fixed order.
// h is read from global memory (small, stays in L1/L2).
template <typename T>
__global__ void __launch_bounds__(kThreads, 4) down_kernel(MoeArgs a, int split) {
  const int slots = a.k + (a.has_shared ? 1 : 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = kWarps / split, sub = warp % split, lr = warp / split;
  // The expert ids are final here: the router finished before gate_up passed its wait.
  for (int r = blockIdx.x * rpb + lr, i = 0; r < a.H && i < a.pf_rows; r += gridDim.x * rpb, ++i)
    for (int j = sub; j < slots; j += split) {
      const bool shared = j == a.k;
      const int I = shared ? a.Is : a.I;
      const T* W = shared ? static_cast<const T*>(a.s_down)
                          : static_cast<const T*>(a.sel ? a.sel[a.k + j] : a.down_tab[a.ids[j]]);
      warp_prefetch(W + size_t(r) * I, size_t(I) * sizeof(T), lane);
    }
  pdl_wait();
  pdl_trigger();
  // kDownRows rows per warp at a time (r, r + stride, ...), one slot after another.
  constexpr int kDownRows = 2;
  __shared__ float part4[kDownRows][kWarps];
  const int stride = gridDim.x * rpb, per = kDownRows;
  for (int r0 = blockIdx.x * rpb; r0 < a.H; r0 += per * stride) {
    const int r = r0 + lr;
    int n = 0;
    while (n < per && r + n * stride < a.H) ++n;
    float acc[kDownRows] = {};
    if (n > 0) {
      for (int j = sub; j < slots; j += split) {
        const bool shared = j == a.k;
        const int I = shared ? a.Is : a.I;
        const T* W = shared ? static_cast<const T*>(a.s_down)
                            : static_cast<const T*>(a.sel ? a.sel[a.k + j] : a.down_tab[a.ids[j]]);
        float d[kDownRows];
        rows_dot<T, kDownRows>(W + size_t(r) * I, size_t(stride) * I, n, a.hb + j * a.maxI, I, lane, d);
#pragma unroll
        for (int i = 0; i < kDownRows; ++i) acc[i] += a.w[j] * warp_sum(d[i]);
      }
    }
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < kDownRows; ++i) part4[i][warp] = acc[i];
    __syncthreads();
    if (sub == 0 && lane == 0)
      for (int i = 0; i < n; ++i) {
        float t = 0.f;
        for (int k = 0; k < split; ++k) t += part4[i][lr * split + k];
        a.x[r + i * stride] += t;
      }
    __syncthreads();
  }
}

// x[r] += sum_j w_j * down_j[r] . h_j, R consecutive rows per block, one warp
// per slot (block = slots warps): each warp resolves its expert once and has
// all R rows' loads in flight at once, so the kernel is one round of loads
// after the wait. Partials are summed over slots in a fixed order.
constexpr int kDownSlotsMax = 12;  // top-k + shared expert; more slots take down_kernel

// The end of a one-warp-per-slot down kernel: warp j's R row partials d,
// weighted by its routing weight wj, summed over the slots in slot order
// into x[0..n) (x already offset to the block's first row).
template <int R>
__device__ __forceinline__ void down_slots_sum(const float* d, float wj, float (*part)[R], int j, int lane, int slots,
                                               int n, float* x) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const float v = warp_sum(d[i]);
    if (lane == 0) part[j][i] = wj * v;
  }
  __syncthreads();
  if (int(threadIdx.x) < n) {
    float t = 0.f;
    for (int s = 0; s < slots; ++s) t += part[s][threadIdx.x];
    x[threadIdx.x] += t;
  }
}
template <typename T, int R>
__global__ void __maxnreg__(112) down_slots_kernel(MoeArgs a) {
  __shared__ float part[kDownSlotsMax][R];
  const int j = threadIdx.x >> 5, lane = threadIdx.x & 31, slots = blockDim.x >> 5;
  const int r0 = blockIdx.x * R, n = min(R, a.H - r0);
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (shared) warp_prefetch(static_cast<const T*>(a.s_down) + size_t(r0) * I, size_t(n) * I * sizeof(T), lane);
  pdl_wait();
  pdl_trigger();
  const T* W = shared ? static_cast<const T*>(a.s_down)
                      : static_cast<const T*>(a.sel ? a.sel[a.k + j] : a.down_tab[a.ids[j]]);
  float d[R];
  rows_dot<T, R, 1>(W + size_t(r0) * I, size_t(I), n, a.hb + j * a.maxI, I, lane, d);
  down_slots_sum<R>(d, a.w[j], part, j, lane, slots, n, a.x + r0);
}

}  // namespace flashmoe::cuda
