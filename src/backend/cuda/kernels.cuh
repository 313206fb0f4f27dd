// Device kernels of the CUDA backend. All math in fp32; weights are read in
// their storage type (float, __half, __nv_bfloat16) with 16-byte loads.
// Kernels that are not templates are static: the decode step (cuda_model.cu)
// and the batched prefill (prefill.cu) both include this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/tier_count.cuh"

namespace flashmoe::cuda {

constexpr int kWarps = 8;  // warps per block in the row kernels
constexpr int kThreads = kWarps * 32;

// ------------------------------------------------------------------ helpers

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (any multiple of 32 threads up to 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float red[32];
  __shared__ float total;
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (l == 0) red[w] = v;
  __syncthreads();
  if (w == 0) {
    float t = l < nw ? red[l] : 0.0f;
    t = warp_sum(t);
    if (l == 0) total = t;
  }
  __syncthreads();
  return total;
}
__device__ __forceinline__ float block_max(float v) {
  __shared__ float red[32];
  __shared__ float total;
  v = warp_max(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (l == 0) red[w] = v;
  __syncthreads();
  if (w == 0) {
    float t = l < nw ? red[l] : -INFINITY;
    t = warp_max(t);
    if (l == 0) total = t;
  }
  __syncthreads();
  return total;
}

// Programmatic dependent launch (Hopper): a kernel may start while the one
// before it drains; it waits here before touching anything that kernel
// writes, then lets the next one start. Before the wait, only weights (and
// data complete two kernels back) may be read. No-ops without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
// The warp prefetches `bytes` bytes from p into L2 (one 128-byte line per lane-step).
__device__ __forceinline__ void warp_prefetch(const void* p, size_t bytes, int lane) {
  for (size_t o = size_t(lane) * 128; o < bytes; o += 32 * 128) prefetch_l2(static_cast<const char*>(p) + o);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// dot of 16 bytes of weights (4 or 8 elements) with xs[0..]
template <typename T>
__device__ __forceinline__ float dot16(const uint4& w, const float* xs) {
  if constexpr (sizeof(T) == 4) {
    const float4 x = *reinterpret_cast<const float4*>(xs);
    return __uint_as_float(w.x) * x.x + __uint_as_float(w.y) * x.y + __uint_as_float(w.z) * x.z +
           __uint_as_float(w.w) * x.w;
  } else {
    const float4 a = *reinterpret_cast<const float4*>(xs);
    const float4 b = *reinterpret_cast<const float4*>(xs + 4);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
    float2 f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        f[i] = make_float2(__uint_as_float(u[i] << 16), __uint_as_float(u[i] & 0xffff0000u));
      } else {
        __half2 h = *reinterpret_cast<const __half2*>(&u[i]);
        f[i] = __half22float2(h);
      }
    }
    return f[0].x * a.x + f[0].y * a.y + f[1].x * a.z + f[1].y * a.w + f[2].x * b.x + f[2].y * b.y +
           f[3].x * b.z + f[3].y * b.w;
  }
}

// One warp's partial dot of a weight row (cols elements, 16-byte aligned,
// cols a multiple of the vector width) with xs in shared memory.
template <typename T>
__device__ __forceinline__ float row_dot(const T* __restrict__ w, const float* xs, int cols, int lane) {
  constexpr int V = 16 / sizeof(T);
  float acc0 = 0.f, acc1 = 0.f;
  int c = lane * V;
  // Two independent loads in flight per iteration, unrolled for more.
#pragma unroll 4
  for (; c + 32 * V < cols; c += 64 * V) {
    const uint4 a = ld_stream(w + c);
    const uint4 b = ld_stream(w + c + 32 * V);
    acc0 += dot16<T>(a, xs + c);
    acc1 += dot16<T>(b, xs + c + 32 * V);
  }
  if (c < cols) acc0 += dot16<T>(ld_stream(w + c), xs + c);
  return acc0 + acc1;
}

// Up to R rows at once (row i at w + i * step; n <= R of them valid), each
// with the same arithmetic as row_dot: the loads of all the rows are issued
// before any is consumed, so a warp has R times the bytes in flight and a
// kernel's chain of dependent load rounds is R times shorter.
// U: column steps unrolled (more loads in flight, more registers).
template <typename T, int R, int U = 2>
__device__ __forceinline__ void rows_dot(const T* __restrict__ w, size_t step, int n, const float* xs, int cols,
                                         int lane, float* out) {
  constexpr int V = 16 / sizeof(T);
  float a0[R], a1[R];
#pragma unroll
  for (int i = 0; i < R; ++i) a0[i] = a1[i] = 0.f;
  int c = lane * V;
#pragma unroll U
  for (; c + 32 * V < cols; c += 64 * V) {
    uint4 p[R], q[R];
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < n) {
        p[i] = ld_stream(w + i * step + c);
        q[i] = ld_stream(w + i * step + c + 32 * V);
      }
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < n) {
        a0[i] += dot16<T>(p[i], xs + c);
        a1[i] += dot16<T>(q[i], xs + c + 32 * V);
      }
  }
  if (c < cols) {
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < n) a0[i] += dot16<T>(ld_stream(w + i * step + c), xs + c);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) out[i] = a0[i] + a1[i];
}

// The norm weights (1 + nw[i]) of this thread's elements, i = threadIdx.x +
// k * blockDim.x, read into registers before the PDL wait: they are weights,
// and read after it they were one more DRAM round trip on every normed
// kernel's critical path (v14 in bench/NOTES-cuda.md).
constexpr int kNormPer = 8;  // elements per thread held (cols <= kNormPer * blockDim.x)
struct NormPre {
  float w[kNormPer];
  bool on = false;
};
__device__ __forceinline__ void norm_preload(const float* __restrict__ nw, int cols, bool on, NormPre& p) {
  p.on = on && nw && cols <= kNormPer * int(blockDim.x);
  if (!p.on) return;
#pragma unroll
  for (int k = 0; k < kNormPer; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    p.w[k] = i < cols ? 1.0f + nw[i] : 1.0f;
  }
}

// xs = x (cols floats), optionally zero-centred-RMS-normed with weight nw
// (its 1 + nw already in registers when pre.on: the same arithmetic).
__device__ __forceinline__ float load_x(const float* __restrict__ x, const float* __restrict__ nw, float eps,
                                        int cols, float* xs, const NormPre* pre = nullptr) {
  float r = 1.0f;
  if (nw && pre && pre->on) {
    float v[kNormPer], ss = 0.f;
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      v[k] = i < cols ? x[i] : 0.f;
      ss += v[k] * v[k];
    }
    ss = block_sum(ss);
    r = 1.0f / sqrtf(ss / float(cols) + eps);
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < cols) xs[i] = v[k] * r * pre->w[k];
    }
  } else if (nw) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
      const float v = x[i];
      ss += v * v;
    }
    ss = block_sum(ss);
    r = 1.0f / sqrtf(ss / float(cols) + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = x[i] * r * (1.0f + nw[i]);
  } else {
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = x[i];
  }
  __syncthreads();
  return r;  // the norm's scale 1/rms(x) (1 without a norm)
}

// ------------------------------------------------------------------ kernels

// x = embed[token]
template <typename T>
__global__ void embed_kernel(const T* __restrict__ E, int H, const int* __restrict__ ids, const int* __restrict__ pos,
                             const int* __restrict__ base, int ring, float* __restrict__ x) {
  pdl_wait();
  pdl_trigger();
  const int tok = ids[(*pos - *base) % ring];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < H; i += gridDim.x * blockDim.x)
    x[i] = to_f<T>(E[size_t(tok) * H + i]);
}

// The first n rows this warp will process in a row kernel (grid-stride over
// blocks of rpb rows, `split` warps per row): prefetched into L2 before the
// kernel waits on its predecessor (PDL), so the weight stream overlaps the
// previous kernel's tail instead of starting after it. The host picks n so
// that what all warps prefetch fits in half the L2.
template <typename T>
__device__ __forceinline__ void prefetch_rows(const T* W, int rows, int cols, int split, int n) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = kWarps / split, sub = warp % split, lr = warp / split, chunk = cols / split;
  for (int r = blockIdx.x * rpb + lr, i = 0; r < rows && i < n; r += gridDim.x * rpb, ++i)
    warp_prefetch(W + size_t(r) * cols + sub * chunk, size_t(chunk) * sizeof(T), lane);
}

// y[r] (+)= W[r,:] . xs for the rows of this block. `split` warps share a
// row (each a slice of the columns; partials summed in a fixed order),
// kWarps/split rows per block, blocks loop over rows (grid-stride), `per`
// rows per warp at a time (2, or 3 for a matrix that needs three rows per
// warp: one batch of loads instead of two). Several rows' loads in flight
// per warp shorten the chain of dependent load rounds; splitting keeps
// enough loads in flight for matrices of few rows.
template <typename T>
__device__ __forceinline__ void matvec_rows(const T* __restrict__ W, int rows, int cols, const float* xs,
                                            float* __restrict__ y, int accumulate, int split, int per,
                                            int bid, int nb) {  // this block's index among the nb doing W
  __shared__ float part[3][kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = kWarps / split, sub = warp % split, lr = warp / split, chunk = cols / split;
  const int stride = nb * rpb;
  for (int r0 = bid * rpb; r0 < rows; r0 += per * stride) {
    const int r = r0 + lr;
    int n = 0;
    while (n < per && r + n * stride < rows) ++n;
    float acc[3] = {0.f, 0.f, 0.f};
    const T* w = W + size_t(r) * cols + sub * chunk;
    if (n == 3) rows_dot<T, 3>(w, size_t(stride) * cols, 3, xs + sub * chunk, chunk, lane, acc);
    else if (n == 2) rows_dot<T, 2>(w, size_t(stride) * cols, 2, xs + sub * chunk, chunk, lane, acc);
    else if (n == 1) acc[0] = row_dot<T>(w, xs + sub * chunk, chunk, lane);
#pragma unroll
    for (int i = 0; i < 3; ++i) acc[i] = warp_sum(acc[i]);
    if (split == 1) {
      if (lane == 0)
        for (int i = 0; i < n; ++i) {
          const int ri = r + i * stride;
          y[ri] = accumulate ? y[ri] + acc[i] : acc[i];
        }
      continue;
    }
    if (lane == 0) part[0][warp] = acc[0], part[1][warp] = acc[1], part[2][warp] = acc[2];
    __syncthreads();
    if (sub == 0 && lane == 0)
      for (int i = 0; i < n; ++i) {
        float t = 0.f;
        for (int k = 0; k < split; ++k) t += part[i][lr * split + k];
        const int ri = r + i * stride;
        y[ri] = accumulate ? y[ri] + t : t;
      }
    __syncthreads();
  }
}

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null).
// per: rows per warp at a time (matvec_rows).
template <typename T>
__global__ void __launch_bounds__(kThreads, 4) matvec_kernel(const T* __restrict__ W, int rows, int cols,
                                                          const float* __restrict__ x, const float* __restrict__ nw,
                                                          float eps, float* __restrict__ y, int accumulate, int split,
                                                          int pf_rows, int per, float* __restrict__ xcopy) {
  extern __shared__ __align__(16) float xs[];
  prefetch_rows(W, rows, cols, split, pf_rows);
  NormPre pre;
  norm_preload(nw, cols, true, pre);
  pdl_wait();
  pdl_trigger();
  // The layer's input residual, kept for the folded router (outproj_router_kernel).
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  if (!nw) {
    // No norm: each warp reads its slice of x straight from L1/L2 alongside
    // the weights, instead of the block staging all of x first.
    matvec_rows(W, rows, cols, x, y, accumulate, split, per, blockIdx.x, gridDim.x);
    return;
  }
  load_x(x, nw, eps, cols, xs, &pre);
  matvec_rows(W, rows, cols, xs, y, accumulate, split, per, blockIdx.x, gridDim.x);
}

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

// GatedDeltaNet causal depthwise conv (kernel K) + SiLU over C channels.
// state: [C][K-1] previous inputs.
static __global__ void conv_kernel(const float* __restrict__ u, int C, int K, const float* __restrict__ taps,
                            float* __restrict__ state, float* __restrict__ out) {
  // The taps and the previous inputs are known before the wait (weights, and
  // this layer's state from the last step): into registers first.
  constexpr int kMaxK = 8;
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  const bool reg = ch < C && K <= kMaxK;
  float tp[kMaxK], st[kMaxK];
  if (reg) {
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      tp[j] = j < K ? taps[size_t(ch) * K + j] : 0.f;
      st[j] = j < K - 1 ? state[size_t(ch) * (K - 1) + j] : 0.f;
    }
  }
  pdl_wait();
  pdl_trigger();
  if (ch >= C) return;
  float* sp = state + size_t(ch) * (K - 1);
  const float v = u[ch];
  if (reg) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      if (j == K - 1) acc = tp[j] * v;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      if (j < K - 1) acc += tp[j] * st[j];
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      if (j + 1 < K - 1) sp[j] = st[j + 1];
    if (K > 1) sp[K - 2] = v;
    out[ch] = siluf_(acc);
    return;
  }
  const float* tpp = taps + size_t(ch) * K;
  float acc = tpp[K - 1] * v;
  for (int j = 0; j < K - 1; ++j) acc += tpp[j] * sp[j];
  for (int j = 0; j + 1 < K - 1; ++j) sp[j] = sp[j + 1];
  if (K > 1) sp[K - 2] = v;
  out[ch] = siluf_(acc);
}

struct DeltaArgs {
  const float* conv;  // [C]: q [nk*dk], k [nk*dk], v [nv*dv] (after conv + silu)
  const float* proj;  // projection output: z at zoff [nv*dv], b at boff [nv], a at aoff [nv]
  int zoff, boff, aoff;
  const float* dt_bias;
  const float* neg_exp_A;
  const float* norm_w;  // [dv]
  float* S;             // [nv][dk][dv]
  float* out;           // [nv*dv]
  int nk, nv, dk, dv;
  float eps;
};

// One block per value head. DK > 0: SPLIT threads per value column j, each
// holding DK/SPLIT rows of the state column in registers (blockDim = dv*SPLIT);
// DK == 0: generic, one thread per column, state read and written in memory.
template <int DK, int SPLIT>
__global__ void delta_kernel(DeltaArgs a) {
  extern __shared__ float sm[];
  float* q = sm;
  float* k = sm + a.dk;
  const int h = blockIdx.x, r = a.nv / a.nk, g = h / r, dk = a.dk, dv = a.dv;
  const int j = threadIdx.x / SPLIT, part = threadIdx.x % SPLIT;
  pdl_wait();
  pdl_trigger();
  float sq = 0.f, sk = 0.f;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    const float qi = a.conv[g * dk + i];
    const float ki = a.conv[a.nk * dk + g * dk + i];
    q[i] = qi;
    k[i] = ki;
    sq += qi * qi;
    sk += ki * ki;
  }
  sq = block_sum(sq);
  sk = block_sum(sk);
  const float rq = (1.0f / sqrtf(float(dk))) / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    q[i] *= rq;
    k[i] *= rk;
  }
  __syncthreads();
  const float beta = sigmoidf_(a.proj[a.boff + h]);
  const float decay = expf(a.neg_exp_A[h] * softplusf_(a.proj[a.aoff + h] + a.dt_bias[h]));
  float o = 0.f;
  const bool active = j < dv;
  float* S = a.S + size_t(h) * dk * dv + (active ? j : 0);
  const int vch = 2 * a.nk * dk + h * dv + j;
  const float v = active ? a.conv[vch] : 0.f;
  if constexpr (DK > 0) {
    constexpr int R = DK / SPLIT;
    const int i0 = part * R;
    float s[R];
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] = active ? S[size_t(i0 + i) * dv] * decay : 0.f;
      m += k[i0 + i] * s[i];
    }
#pragma unroll
    for (int o2 = 1; o2 < SPLIT; o2 <<= 1) m += __shfl_xor_sync(0xffffffffu, m, o2);
    const float d = (v - m) * beta;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] += k[i0 + i] * d;
      o += q[i0 + i] * s[i];
      if (active) S[size_t(i0 + i) * dv] = s[i];
    }
#pragma unroll
    for (int o2 = 1; o2 < SPLIT; o2 <<= 1) o += __shfl_xor_sync(0xffffffffu, o, o2);
  } else if (active) {
    float m = 0.f;
    for (int i = 0; i < dk; ++i) {
      const float si = S[size_t(i) * dv] * decay;
      S[size_t(i) * dv] = si;
      m += k[i] * si;
    }
    const float d = (v - m) * beta;
    for (int i = 0; i < dk; ++i) {
      const float si = S[size_t(i) * dv] + k[i] * d;
      S[size_t(i) * dv] = si;
      o += q[i] * si;
    }
  }
  const float ss = block_sum(active && part == 0 ? o * o : 0.f);
  if (active && part == 0) {
    const float rn = 1.0f / sqrtf(ss / float(dv) + a.eps);
    a.out[h * dv + j] = o * rn * a.norm_w[j] * siluf_(a.proj[a.zoff + h * dv + j]);
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
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
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
  // Expert selection by the last router block (sel.out null: none).
  int E, k;
  int* ids;
  float* wscratch;  // [k] (the weights are gate_up's)
  TierCount tc;
  ExpertSel sel;
  unsigned* done;  // router blocks finished (zero between launches)
};
template <typename T>
__global__ void __launch_bounds__(kThreads) outproj_router_kernel(const T* __restrict__ W, OutRouterArgs a) {
  if (a.sel.out && blockIdx.x == 0 && threadIdx.x < 32) prefetch_tables(a.sel, a.E);
  pdl_wait();
  pdl_trigger();
  if (int(blockIdx.x) < a.nbR) {
    matvec_rows<float>(a.R, a.rowsR, a.H + a.O, a.cat, a.logits, 0, a.splitR, 2, blockIdx.x, a.nbR);
    if (!a.sel.out) return;
    // The last router block picks the experts. The top-k of logits * s is
    // that of the logits for any s > 0, so the pick needs no rms(x_new): it
    // happens here, while the projection blocks still run, instead of at the
    // start of every gate_up block. gate_up's first block computes the
    // weights, which do need it (topk_weights).
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.done, 1u) == unsigned(a.nbR - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < 32) topk_warp(a.logits, a.E, a.k, 0, 0, a.ids, a.wscratch, a.tc, a.sel, 1.0f);
    if (threadIdx.x == 0) *a.done = 0;
    return;
  }
  matvec_rows<T>(W, a.H, a.O, a.cat + a.H, a.x, 1, a.splitA, 2, int(blockIdx.x) - a.nbR, a.nbA);
}

struct MoeArgs {
  const void* const* gu_tab;    // [E] routed expert e's gate/up rows [2I][H] (VRAM or pinned host)
  const void* const* down_tab;  // [E] routed expert e's down rows [H][I]
  const void* s_gu;    // shared / dense [2Is][H]
  const void* s_down;  // [H][Is]
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
  TierCount tc;
  ExpertSel tsel;  // tables; .out: where block (0,0) publishes the row pointers
  int* ids_out;
  float* w_out;
};

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
    W = static_cast<const T*>(chosen[j]);
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
constexpr int kDown2MaxSlots = 12;  // top-k + shared expert; more slots take down_kernel

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
__global__ void __maxnreg__(112) down2_kernel(MoeArgs a) {
  __shared__ float part[kDown2MaxSlots][R];
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

// Greedy: argmax of logits (ties: lower index) -> ids ring at pos+1, out[step].
// The chosen token's embedding row goes into L2 for the next step's embed
// kernel (erow bytes per row at E; null: not done).
static __global__ void argmax_kernel(const float* __restrict__ logits, int V, int* ids, const int* pos, const int* base,
                              int ring, int* out, const int* step, const char* E, size_t erow) {
  pdl_wait();
  pdl_trigger();
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  auto take = [&](float v, int i) {
    if (v > bv) {
      bv = v;
      bi = i;
    }
  };
  // 16-byte loads, eight in flight per thread (one thread per element was
  // a chain of V / blockDim dependent rounds); indices still rise per thread.
  const int V4 = (reinterpret_cast<uintptr_t>(logits) % 16 == 0) ? V / 4 : 0;
  const float4* l4 = reinterpret_cast<const float4*>(logits);
#pragma unroll 8
  for (int i = threadIdx.x; i < V4; i += blockDim.x) {
    const float4 v = l4[i];
    take(v.x, 4 * i);
    take(v.y, 4 * i + 1);
    take(v.z, 4 * i + 2);
    take(v.w, 4 * i + 3);
  }
  for (int i = 4 * V4 + threadIdx.x; i < V; i += blockDim.x) take(logits[i], i);
  __shared__ float sv[32];
  __shared__ int si[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) {
    sv[w] = bv;
    si[w] = bi;
  }
  __syncthreads();
  if (w == 0) {
    const int nw = blockDim.x >> 5;
    bv = l < nw ? sv[l] : -INFINITY;
    bi = l < nw ? si[l] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (bi == 0x7fffffff) bi = 0;  // all NaN: still a valid id
    if (l == 0) {
      ids[(*pos + 1 - *base) % ring] = bi;
      out[*step] = bi;
    }
    if (E) warp_prefetch(E + size_t(bi) * erow, erow, l);
  }
}

// End of a step: position and step counters advance.
static __global__ void advance_kernel(int* pos, int* step) {
  pdl_wait();
  *pos += 1;
  *step += 1;
}

// Deterministic pseudo-random fill (synthetic weights): uniform in [-scale, scale).
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}
template <typename T>
__global__ void fill_random_kernel(T* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = float(hash32(seed * 0x9E3779B97F4A7C15ULL + i)) * (1.0f / 4294967296.0f) * 2.0f - 1.0f;
    if constexpr (std::is_same_v<T, float>) p[i] = u * scale;
    else p[i] = __float2bfloat16_rn(u * scale);
  }
}
static __global__ void fill_bytes_kernel(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = hash32(seed * 0x9E3779B97F4A7C15ULL + i);
}
// n bf16 values v at byte offset off of each of E blocks of `stride` bytes.
static __global__ void fill_bf16_parts_kernel(uint8_t* base, size_t stride, int E, size_t off, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(E) * n; i += size_t(gridDim.x) * blockDim.x)
    reinterpret_cast<__nv_bfloat16*>(base + (i / n) * stride + off)[i % n] = __float2bfloat16_rn(v);
}
static __global__ void fill_const_kernel(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}

}  // namespace flashmoe::cuda
