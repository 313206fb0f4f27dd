// MoE routing of the decode step: the top-k over the router logits, and
// the router folded into the output projection's launch (outproj_router_kernel),
// whose last router block makes the pick.
#pragma once
#include "backend/cuda/matvec.cuh"

namespace flashmoe::cuda {

// R (see outproj_router_kernel) from the router Wr [rows][H], the norm
// weight w [H] and W_out [H][O]; accumulated in double, once at upload.
template <typename T>
__global__ void fold_router_kernel(const T* __restrict__ Wr, int rows, const float* __restrict__ w,
                                   const T* __restrict__ Wout, int H, int O, float* __restrict__ R) {
  const int e = blockIdx.y;
  const T* wr = Wr + size_t(e) * H;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < H + O; c += gridDim.x * blockDim.x) {
    double v = 0.0;
    if (c < H) {
      v = double(to_f<T>(wr[c])) * (1.0 + double(w[c]));
    } else {
      for (int h = 0; h < H; ++h)
        v += double(to_f<T>(wr[h])) * (1.0 + double(w[h])) * double(to_f<T>(Wout[size_t(h) * O + (c - H)]));
    }
    R[size_t(e) * (H + O) + c] = float(v);
  }
}

// Where the chosen experts' rows are (VRAM or pinned host memory): the top-k
// resolves them once, so the expert kernels read a pointer instead of
// chasing ids -> table -> rows (two more dependent memory rounds each).
struct ExpertSel {
  const void* const* gu_tab;    // [E] each expert's gate/up rows
  const void* const* down_tab;  // [E] each expert's down rows
  const void** out;             // [2k]: the chosen experts' gate/up rows, then their down rows (null: not used)
};

// Router: softmax over E logits, top-k (ties: lower index), renormalised
// weights; the shared expert's gate logit is logits[E]. One warp, E <= 512.
// Logits are read through L2 (.cg): in outproj_router_kernel they were
// written by other blocks of the same grid.
__device__ __forceinline__ void topk_warp(const float* logits, int E, int k, int norm_topk, int has_shared, int* ids,
                                          float* w, TierCount tc, ExpertSel sel, float scale = 1.0f) {
  constexpr int PER = 16;
  const int lane = threadIdx.x & 31;
  float v[PER];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = i * 32 + lane;
    v[i] = e < E ? __ldcg(logits + e) * scale : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = i * 32 + lane;
    v[i] = e < E ? expf(v[i] - mx) : -1.0f;
    sum += e < E ? v[i] : 0.f;
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (i * 32 + lane < E) v[i] /= sum;
  float chosen_sum = 0.f, chosen_p = 0.f;
  int chosen_id = 0;
  for (int r = 0; r < k; ++r) {
    float bv = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = i * 32 + lane;
      if (v[i] > bv) {
        bv = v[i];
        bi = e;
      }
    }
    warp_argmax(bv, bi);
#pragma unroll
    for (int i = 0; i < PER; ++i)
      if (i * 32 + lane == bi) v[i] = -1.0f;
    chosen_sum += bv;
    if (lane == r) chosen_p = bv, chosen_id = bi;
    if (lane == 0) {
      ids[r] = bi;
      if (tc.counts) {
        atomicAdd(tc.counts + bi, 1u);
        atomicAdd(tc.hits + (tc.tier[bi] ? 1 : 0), 1ull);
      }
    }
  }
  if (lane < k) w[lane] = norm_topk ? chosen_p / chosen_sum : chosen_p;
  if (lane == 0 && has_shared) w[k] = sigmoidf_(__ldcg(logits + E) * scale);
  if (sel.out && lane < k) {
    sel.out[lane] = sel.gu_tab[chosen_id];
    sel.out[k + lane] = sel.down_tab[chosen_id];
  }
}

// The pointer tables into L2 before the wait (they change only between steps).
__device__ __forceinline__ void prefetch_tables(const ExpertSel& sel, int E) {
  if (!sel.out) return;
  const int lane = threadIdx.x & 31;
  warp_prefetch(sel.gu_tab, size_t(E) * sizeof(void*), lane);
  warp_prefetch(sel.down_tab, size_t(E) * sizeof(void*), lane);
}

static __global__ void topk_kernel(const float* __restrict__ logits, int E, int k, int norm_topk, int has_shared,
                            int* __restrict__ ids, float* __restrict__ w, TierCount tc, ExpertSel sel) {
  prefetch_tables(sel, E);
  pdl_wait();
  pdl_trigger();
  topk_warp(logits, E, k, norm_topk, has_shared, ids, w, tc, sel);
}

// The routing weights of experts already picked (ids): softmax of
// logits * scale over all E, taken at the picks, renormalised over them when
// norm_topk; w[k] = the shared expert's gate. One warp, E <= 512.
__device__ __forceinline__ void topk_weights(const float* logits, int E, int k, int norm_topk, int has_shared,
                                             const int* ids, float scale, float* w) {
  constexpr int PER = 16;
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = i * 32 + lane;
    if (e < E) mx = fmaxf(mx, __ldcg(logits + e) * scale);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = i * 32 + lane;
    if (e < E) sum += expf(__ldcg(logits + e) * scale - mx);
  }
  sum = warp_sum(sum);
  const float p = lane < k ? expf(__ldcg(logits + ids[lane]) * scale - mx) / sum : 0.f;
  const float chosen = warp_sum(p);
  if (lane < k) w[lane] = norm_topk ? p / chosen : p;
  if (lane == 0 && has_shared) w[k] = sigmoidf_(__ldcg(logits + E) * scale);
}

// The output projection and the MoE router in one launch. The router reads
// the residual after this projection, normed: Wr . norm(x + W_out . o). With
// the norm weight and W_out folded into it at upload,
//   R = [ Wr (1 + w) | Wr (1 + w) W_out ]   (fp32, rows x (H + O)),
// rms(x_new) times its logits is R . [x ; o], x the residual before this
// projection (copied by the in-proj kernel into cat, in front of o). So the
// router rows no longer wait for the projection: blocks [0, nbR) compute
// them while the others compute x += W_out . o, and gate_up divides by
// rms(x_new), which its norm computes anyway, for the routing weights. This
// removes the router kernel and its boundary from every MoE layer.
struct OutRouterArgs {
  const float* cat;  // [H + O]: the residual before this projection, then o
  float* x;          // [H] residual, += W_out . o
  const float* R;    // [rowsR][H + O]
  float* logits;     // [rowsR] R . cat
  int H, O, rowsR;
  int splitA, splitR, nbA, nbR;
  int per;  // rows per warp at a time in both parts (matvec_rows; the host sets 2)
  // Expert selection by the last router block (sel.out null: none).
  int E, k;
  int* ids;
  float* wscratch;  // [k] (the weights are gate_up's)
  TierCount tc;
  ExpertSel sel;
  unsigned* done;  // router blocks finished (zero between launches)
};
// A router block of outproj_router_kernel (blocks [0, nbR)): its rows of the
// folded router's logits; the last router block to finish picks the
// experts. The top-k of logits * s is that of the logits for any s > 0, so
// the pick needs no rms(x_new): it happens here, while the projection
// blocks still run, instead of at the start of every gate_up block.
// gate_up's first block computes the weights, which do need it
// (topk_weights).
__device__ __forceinline__ void router_block(const OutRouterArgs& a, int rb) {  // rb: this block's index of the nbR
  matvec_rows<float>(a.R, a.rowsR, a.H + a.O, a.cat, a.logits, 0, a.splitR, a.per, rb, a.nbR);
  if (!a.sel.out) return;
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.done, 1u) == unsigned(a.nbR - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x < 32) topk_warp(a.logits, a.E, a.k, 0, 0, a.ids, a.wscratch, a.tc, a.sel, 1.0f);
  if (threadIdx.x == 0) *a.done = 0;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) outproj_router_kernel(const T* __restrict__ W, OutRouterArgs a) {
  if (a.sel.out && blockIdx.x == 0 && threadIdx.x < 32) prefetch_tables(a.sel, a.E);
  pdl_wait();
  pdl_trigger();
  if (int(blockIdx.x) < a.nbR) {
    router_block(a, blockIdx.x);
    return;
  }
  matvec_rows<T>(W, a.H, a.O, a.cat + a.H, a.x, 1, a.splitA, a.per, int(blockIdx.x) - a.nbR, a.nbA);
}

}  // namespace flashmoe::cuda
