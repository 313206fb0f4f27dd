// Kernels of the batched prefill (prefill.cu): a chunk of T tokens through
// one layer at a time, every token's rows side by side ([T][width] buffers).
// The products are gemm.cuh's; these are the per-token and per-channel steps
// around them, each the decode step's arithmetic for T tokens at once.
#pragma once
#include "backend/cuda/attention.cuh"
#include "backend/cuda/prefill.cuh"
#include "backend/cuda/router.cuh"

namespace flashmoe::cuda {

// x[t] = embed[ids[t]] (grid: T blocks).
template <typename T>
__global__ void embed_rows_kernel(const T* __restrict__ E, int H, const int* __restrict__ ids, float* __restrict__ x) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const size_t tok = size_t(ids[blockIdx.x]);
  for (int i = threadIdx.x; i < H; i += blockDim.x) x[size_t(blockIdx.x) * H + i] = to_f<T>(E[tok * H + i]);
}

// y[t] = x[t] / rms(x[t]) * (1 + w), zero-centred RMS norm (grid: T blocks),
// and y also split into hi/lo bf16 rows [T][H] where hi is given (the
// skinny products of a batched step read those: one launch, not two).
__global__ void norm_rows_kernel(const float* __restrict__ x, const float* __restrict__ w, int H, float eps,
                                 float* __restrict__ y, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const size_t r0 = size_t(blockIdx.x) * H;
  const float* xr = x + r0;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = xr[i] * r * (1.0f + w[i]);
    y[r0 + i] = v;
    if (hi) split_bf16(v, hi[r0 + i], lo[r0 + i]);
  }
}

// Causal depthwise conv (kernel K <= 8) + SiLU, one thread per (channel,
// row): the K inputs of a row are its sequence's own rows of the pass, or
// that sequence's state [C][K-1] (the previous K-1 inputs, oldest first)
// before them. The taps in conv_kernel's order. conv_state_kernel then
// moves the states on.
__global__ void conv_rows_kernel(const float* __restrict__ u, int ustride, int C, int K, const float* __restrict__ taps,
                                 PassSeqs p, float* __restrict__ out) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
  if (ch >= C) return;
  const int j = p.seq[r], first = p.r0[j];
  const float* state = p.conv[j];
  const float* tp = taps + size_t(ch) * K;
  float acc = tp[K - 1] * u[size_t(r) * ustride + ch];
  for (int i = 0; i < K - 1; ++i) {
    const int rr = r - (K - 1) + i;  // pass row of tap i
    acc += tp[i] * (rr >= first ? u[size_t(rr) * ustride + ch] : state[size_t(ch) * (K - 1) + (K - 1) + rr - first]);
  }
  out[size_t(r) * C + ch] = siluf_(acc);
}

// Each sequence's conv state after its rows (grid: channels x sequences):
// its last K-1 inputs (older ones from the state when it has fewer rows).
__global__ void conv_state_kernel(const float* __restrict__ u, int ustride, int C, int K, PassSeqs p) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x, j = blockIdx.y;
  if (ch >= C || K < 2) return;
  const int first = p.r0[j], T = p.r0[j + 1] - first;
  float* st = p.conv[j] + size_t(ch) * (K - 1);
  float v[8];
  for (int i = 0; i < K - 1; ++i) {
    const int r = T - (K - 1) + i;
    v[i] = r >= 0 ? u[size_t(first + r) * ustride + ch] : st[(K - 1) + r];
  }
  for (int i = 0; i < K - 1; ++i) st[i] = v[i];
}

// Per token (blockIdx.x) the delta rule's inputs that do not depend on the
// state: q and k of every key head L2-normed in place in the conv output
// (q also scaled by 1/sqrt(dk)), and per value head beta = sigmoid(b) and the
// decay exp(-exp(A) softplus(a + dt_bias)).
struct DeltaRowsArgs {
  float* conv;  // [T][C]: q [nk*dk], k [nk*dk], v [nv*dv]
  int C;
  const float* proj;  // [T][pstride]: b at boff, a at aoff
  int pstride, boff, aoff, zoff;
  const float* dt_bias;
  const float* neg_exp_A;
  const float* norm_w;  // [dv]
  float* beta;          // [T][nv]
  float* decay;         // [T][nv]
  float* out;           // [T][nv*dv]: raw, then gated-normed
  int nk, nv, dk, dv;
  float eps;
  int tiled = 0;  // value head h reads key head h % nk (DeltaArgs::tiled)
};

__global__ void delta_rows_kernel(DeltaRowsArgs a) {
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  float* row = a.conv + size_t(t) * a.C;
  for (int v = warp; v < 2 * a.nk; v += nw) {  // v < nk: q of head v; else k of head v - nk
    float* x = row + size_t(v) * a.dk;
    float ss = 0.f;
    for (int i = lane; i < a.dk; i += 32) ss += x[i] * x[i];
    ss = warp_sum(ss);
    const float r = v < a.nk ? (1.0f / sqrtf(float(a.dk))) / sqrtf(ss + 1e-6f) : 1.0f / sqrtf(ss + 1e-6f);
    for (int i = lane; i < a.dk; i += 32) x[i] *= r;
  }
  const float* p = a.proj + size_t(t) * a.pstride;
  for (int h = threadIdx.x; h < a.nv; h += blockDim.x) {
    a.beta[size_t(t) * a.nv + h] = sigmoidf_(p[a.boff + h]);
    a.decay[size_t(t) * a.nv + h] = expf(a.neg_exp_A[h] * softplusf_(p[a.aoff + h] + a.dt_bias[h]));
  }
}

// The delta-rule recurrence over each sequence's rows, in order. Columns of
// the state are independent, so a block takes 32 columns of one value head
// (grid: nv x dv/32), SPLIT = DK/R threads per column each holding R rows
// of it in registers for all T tokens. The tokens are a serial chain, so
// what bounds the kernel is each token's latency: R = 8 rows per thread
// (a 4x shorter chain of dependent instructions than 32, and 4x the warps
// to interleave; ncu showed one warp per scheduler issuing every 5.6 cycles).
// q, k, v, beta and decay of kTB tokens at a time are staged in shared
// memory (q/k rows padded per thread part so the 16-byte reads of a
// quarter-warp's parts fall in distinct banks). out: raw o.
// Grid z: the pass's sequences (p), each over its own rows of a's arrays
// (conv, beta, decay, out) with its own state ssm[z].
template <int DK>
__global__ void __launch_bounds__(DK * 4) delta_scan_kernel(DeltaRowsArgs a, PassSeqs p) {
  constexpr int R = 8, SPLIT = DK / R, kTB = 2048 / DK < 32 ? 2048 / DK : 32, kPad = R + 4, kRow = SPLIT * kPad;
  __shared__ __align__(16) float qs[kTB][kRow], ks[kTB][kRow];
  __shared__ float vs[kTB][32], bs[kTB], ds[kTB];
  const int h = blockIdx.x, g = a.tiled ? h % a.nk : h / (a.nv / a.nk), c0 = blockIdx.y * 32;
  const int col = threadIdx.x / SPLIT, part = threadIdx.x % SPLIT, j = c0 + col;
  const int first = p.r0[blockIdx.z], T = p.r0[blockIdx.z + 1] - first;
  const float* conv = a.conv + size_t(first) * a.C;
  const float* beta = a.beta + size_t(first) * a.nv;
  const float* decay_rows = a.decay + size_t(first) * a.nv;
  float* out = a.out + size_t(first) * a.nv * a.dv;
  float* S = p.ssm[blockIdx.z] + size_t(h) * DK * a.dv + j;
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = S[size_t(part * R + i) * a.dv];
  for (int t0 = 0; t0 < T; t0 += kTB) {
    const int nt = min(kTB, T - t0);
    __syncthreads();
    for (int i = threadIdx.x; i < nt * DK; i += blockDim.x) {
      const int tt = i / DK, d = i % DK, at = (d / R) * kPad + d % R;
      const float* row = conv + size_t(t0 + tt) * a.C;
      qs[tt][at] = row[g * DK + d];
      ks[tt][at] = row[a.nk * DK + g * DK + d];
    }
    for (int i = threadIdx.x; i < nt * 32; i += blockDim.x) {
      const int tt = i / 32, cc = i % 32;
      vs[tt][cc] = conv[size_t(t0 + tt) * a.C + 2 * a.nk * DK + h * a.dv + c0 + cc];
    }
    if (threadIdx.x < nt) {
      bs[threadIdx.x] = beta[size_t(t0 + threadIdx.x) * a.nv + h];
      ds[threadIdx.x] = decay_rows[size_t(t0 + threadIdx.x) * a.nv + h];
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      const float4* k4 = reinterpret_cast<const float4*>(&ks[tt][part * kPad]);
      const float4* q4 = reinterpret_cast<const float4*>(&qs[tt][part * kPad]);
      const float decay = ds[tt];
      float mp[2] = {0.f, 0.f};
#pragma unroll
      for (int i = 0; i < R / 4; ++i) {
        const float4 k = k4[i];
        s[4 * i] *= decay, s[4 * i + 1] *= decay, s[4 * i + 2] *= decay, s[4 * i + 3] *= decay;
        mp[0] += k.x * s[4 * i] + k.y * s[4 * i + 1];
        mp[1] += k.z * s[4 * i + 2] + k.w * s[4 * i + 3];
      }
      float m = mp[0] + mp[1];
#pragma unroll
      for (int o = 1; o < SPLIT; o <<= 1) m += __shfl_xor_sync(0xffffffffu, m, o);
      const float d = (vs[tt][col] - m) * bs[tt];
      float op[2] = {0.f, 0.f};
#pragma unroll
      for (int i = 0; i < R / 4; ++i) {
        const float4 k = k4[i], q = q4[i];
        s[4 * i] += k.x * d, s[4 * i + 1] += k.y * d, s[4 * i + 2] += k.z * d, s[4 * i + 3] += k.w * d;
        op[0] += q.x * s[4 * i] + q.y * s[4 * i + 1];
        op[1] += q.z * s[4 * i + 2] + q.w * s[4 * i + 3];
      }
      float o = op[0] + op[1];
#pragma unroll
      for (int w = 1; w < SPLIT; w <<= 1) o += __shfl_xor_sync(0xffffffffu, o, w);
      if (part == 0) out[size_t(t0 + tt) * a.nv * a.dv + size_t(h) * a.dv + j] = o;
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) S[size_t(part * R + i) * a.dv] = s[i];
}

// out[t][h] = rmsnorm(o) * w * silu(z), in place (grid: T x nv, >= dv threads).
__global__ void gated_norm_rows_kernel(DeltaRowsArgs a) {
  const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
  float* o = a.out + size_t(t) * a.nv * a.dv + size_t(h) * a.dv;
  const float v = j < a.dv ? o[j] : 0.f;
  const float ss = block_sum(v * v);
  if (j >= a.dv) return;
  const float rn = 1.0f / sqrtf(ss / float(a.dv) + a.eps);
  o[j] = v * rn * a.norm_w[j] * siluf_(a.proj[size_t(t) * a.pstride + a.zoff + h * a.dv + j]);
}

// Router top-k of each token (grid: T blocks of one warp): ids [T][k],
// weights [T][k+1] (the shared expert's gate last); the tiered cache's
// counters see every choice, as in decode.
__global__ void topk_rows_kernel(const float* __restrict__ logits, int lstride, int E, int k, int norm_topk,
                                 int has_shared, int* ids, float* w, TierCount tc) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const int t = blockIdx.x;
  topk_warp(logits + size_t(t) * lstride, E, k, norm_topk, has_shared, ids + size_t(t) * k, w + size_t(t) * (k + 1),
            tc, ExpertSel{nullptr, nullptr, nullptr});
}

// The chunk's (token, expert) pairs grouped by expert (one block of 512
// threads, E <= 512): pair t*k+j gets row p of its expert's range;
// tok[p] = t, dest[p] = t*k+j; the ranges cut into tiles of at most BM rows
// for gemm_kernel's grouped mode. Offsets by a scan over the experts.
// tile_done[0, ndone): the tiles' counts of finished blocks
// (GemmArgs::tile_done), zeroed.
__global__ void __launch_bounds__(512) route_lists_kernel(const int* __restrict__ ids, int T, int k, int E, int BM,
                                                          int* tok, int* dest, int* tiles, int* ntiles,
                                                          int* tile_done, int ndone) {
  __shared__ int cnt[512], cur[512], sc[2][512], st[2][512];
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const int e = threadIdx.x;
  for (int i = e; i < ndone; i += blockDim.x) tile_done[i] = 0;
  cnt[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < T * k; i += blockDim.x) atomicAdd(&cnt[ids[i]], 1);
  __syncthreads();
  // Inclusive scans (Hillis-Steele) of the row counts and the tile counts.
  int b = 0;
  sc[0][e] = e < E ? cnt[e] : 0;
  st[0][e] = e < E ? (cnt[e] + BM - 1) / BM : 0;
  __syncthreads();
  for (int o = 1; o < 512; o <<= 1) {
    sc[b ^ 1][e] = sc[b][e] + (e >= o ? sc[b][e - o] : 0);
    st[b ^ 1][e] = st[b][e] + (e >= o ? st[b][e - o] : 0);
    b ^= 1;
    __syncthreads();
  }
  if (e < E) {
    const int off = sc[b][e] - cnt[e];
    int nt = st[b][e] - (cnt[e] + BM - 1) / BM;
    cur[e] = off;
    for (int m = 0; m < cnt[e]; m += BM, ++nt) {
      tiles[3 * nt] = e;
      tiles[3 * nt + 1] = off + m;
      tiles[3 * nt + 2] = off + min(cnt[e], m + BM);
    }
  }
  if (e == 511) *ntiles = st[b][511];
  __syncthreads();
  for (int i = threadIdx.x; i < T * k; i += blockDim.x) {
    const int p = atomicAdd(&cur[ids[i]], 1);
    tok[p] = i / k;
    dest[p] = i;
  }
}

// x[t] += sum_j w[t][j] y[t*k + j] (+ w[t][k] ysh[t]): the routed experts'
// outputs (and the shared expert's), in slot order (grid: T blocks).
__global__ void moe_combine_kernel(float* __restrict__ x, int H, const float* __restrict__ y,
                                   const float* __restrict__ ysh, const float* __restrict__ w, int k) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const int t = blockIdx.x;
  const float* wt = w + size_t(t) * (k + 1);
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += wt[j] * y[(size_t(t) * k + j) * H + i];
    if (ysh) acc += wt[k] * ysh[size_t(t) * H + i];
    x[size_t(t) * H + i] += acc;
  }
}

// moe_combine_kernel, then the next layer's input norm of the row (as
// norm_rows_kernel: xn = rms_norm(x) * (1 + nw)) in the same block, and xn
// also split into hi/lo bf16 rows where xhi is given (the next layer's
// in-projection reads those).
__global__ void moe_combine_norm_kernel(float* __restrict__ x, int H, const float* __restrict__ y,
                                        const float* __restrict__ ysh, const float* __restrict__ w, int k,
                                        const float* __restrict__ nw, float eps, float* __restrict__ xn,
                                        __nv_bfloat16* xhi, __nv_bfloat16* xlo) {
  pdl_wait();  // under PDL (a batched decode step): the kernel before has finished
  pdl_trigger();
  const int t = blockIdx.x;
  const float* wt = w + size_t(t) * (k + 1);
  float* xr = x + size_t(t) * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += wt[j] * y[(size_t(t) * k + j) * H + i];
    if (ysh) acc += wt[k] * ysh[size_t(t) * H + i];
    const float v = xr[i] + acc;
    xr[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = xr[i] * r * (1.0f + nw[i]);
    xn[size_t(t) * H + i] = v;
    if (xhi) split_bf16(v, xhi[size_t(t) * H + i], xlo[size_t(t) * H + i]);
  }
}

// Attention of a chunk's queries (grid: nh / hpb x T; 256 threads), position
// p0 + t over the positions its cache policy keeps visible: all before it
// (full), the last W (window), or the sinks and the last W - sinks
// (streaming). Positions before p0 come from the cache (its state at the
// start of the chunk), the chunk's own from `stage` (windowed caches: the
// chunk's K/V are committed after all its queries ran) or from the cache
// (full retention: written in place by attn_prep). One pass with a running
// max per warp (online softmax): no score buffer of the chunk's size.
// Lanes take 8 consecutive dims (hd % 8 == 0, hd <= 256).
struct AttnRowsArgs {
  const float* q;     // [T][nh*hd]
  const float* gate;  // qkv rows [T][gstride]: gate of head h at h*2*hd + hd (null: ungated, rotated KV)
  int gstride;
  float* out;  // [T][nh*hd]
  KvLayer kv;
  KvLayer stage;  // k/v/ks/vs rows by chunk token; null k: the chunk is in kv
  int p0, nh, nkv, hd, ns;
  int hpb;  // query heads per block (of one KV head; divides 8): grid.x = nh / hpb
  float scale;
  float* lse = nullptr;  // h2o: [T][nh] log of each query's softmax denominator (max included)
};

template <int KVT>
__global__ void __launch_bounds__(256) attn_rows_kernel(AttnRowsArgs a) {
  constexpr int kU = 4, kW = 8;
  __shared__ float ml[kW][2];
  __shared__ __align__(16) float part[kW][256];
  // Warp w: query head blockIdx.x * hpb + w % hpb, slice w / hpb of the
  // positions. The block's heads share one KV head, so its warps read the
  // same K/V rows at about the same time: from L2 once, then from L1.
  const int hpb = a.hpb, nsl = kW / hpb, t = blockIdx.y, P = a.p0 + t, hd = a.hd;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row = a.nkv * hd;
  const int h = blockIdx.x * hpb + warp % hpb, sl = warp / hpb, kvh = h / (a.nh / a.nkv);
  const KvLayer& L = a.kv;
  int nA = 0, lo = 0;  // visible: [0, nA) and [lo, P]
  if (L.window > 0) {
    nA = min(L.sinks, P + 1);
    lo = max(L.sinks, P - (L.window - L.sinks) + 1);
  }
  const int n = nA + max(0, P - lo + 1);
  const bool on = lane * 8 < hd;
  float q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = on ? a.q[(size_t(t) * a.nh + h) * hd + lane * 8 + i] : 0.f;
  float mx = -INFINITY, l = 0.f, acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  for (int i0 = sl * kU; i0 < n; i0 += nsl * kU) {
    float kv[kU][8], vv[kU][8], ksc[kU], vsc[kU], e[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int idx = min(i0 + u, n - 1), pos = idx < nA ? idx : lo + (idx - nA);
      const bool st = a.stage.k && pos >= a.p0;
      const KvLayer& src = st ? a.stage : L;
      const int slot = st ? pos - a.p0 : kv_slot(L, pos);
      const size_t off = size_t(slot) * row + size_t(kvh) * hd + lane * 8;
      ksc[u] = vsc[u] = 1.f;
      if constexpr (KVT == KV_FP8) {
        const size_t so = size_t(slot) * a.ns + (a.ns == 1 ? 0 : kvh);
        ksc[u] = src.ks[so];
        vsc[u] = src.vs[so];
      }
      if (on) {
        kv_load8<KVT>(src.k, off, kv[u]);
        kv_load8<KVT>(src.v, off, vv[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float d = 0.f;
      if (on)
#pragma unroll
        for (int i = 0; i < 8; ++i) d += q[i] * kv[u][i];
      d = warp_sum(d);
      e[u] = i0 + u < n ? d * ksc[u] * a.scale : -INFINITY;
    }
    float m2 = mx;
#pragma unroll
    for (int u = 0; u < kU; ++u) m2 = fmaxf(m2, e[u]);
    const float corr = expf(mx - m2);  // mx = -inf the first time: 0
    l *= corr;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= corr;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const float p = expf(e[u] - m2);  // 0 past the end
      l += p;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += p * vv[u][i] * vsc[u];
    }
    mx = m2;
  }
  if (lane == 0) ml[warp][0] = mx, ml[warp][1] = l;
  if (on)
#pragma unroll
    for (int i = 0; i < 8; ++i) part[warp][lane * 8 + i] = acc[i];
  __syncthreads();
  for (int i = threadIdx.x; i < hpb * hd; i += blockDim.x) {
    const int hh = i / hd, d = i % hd, oh = blockIdx.x * hpb + hh;  // warps hh, hh + hpb, ...
    float M = -INFINITY;
    for (int w = hh; w < kW; w += hpb) M = fmaxf(M, ml[w][0]);
    float Ls = 0.f, o = 0.f;
    for (int w = hh; w < kW; w += hpb)
      if (ml[w][1] > 0.f) {
        const float f = expf(ml[w][0] - M);
        Ls += ml[w][1] * f;
        o += part[w][d] * f;
      }
    a.out[(size_t(t) * a.nh + oh) * hd + d] =
        o / Ls * (a.gate ? sigmoidf_(a.gate[size_t(t) * a.gstride + oh * 2 * hd + hd + d]) : 1.f);
    if (a.lse && d == 0) a.lse[size_t(t) * a.nh + oh] = M + logf(Ls);
  }
}

// h2o, a chunk that evicts nothing (p0 + T <= cap: slot = position): each
// slot's score += its probability under every query of the chunk that sees
// it (p0 + t >= slot), every head: what the chunk's token-by-token steps
// would add (h2o_acc_kernel), in another order. The probabilities are
// recomputed from q, K and attn_rows_kernel's lse, as a tiled product: a
// block takes 64 slots x 64 query rows (t, g) of one KV head at a time
// (each thread 4 x 4, hd in steps of 32 through shared memory), kH2oRowTiles
// row tiles in turn, and writes the probabilities summed over its rows to
// part[y][slot]; h2o_rows_sum_kernel adds the parts in order. No atomics:
// the same sums on every run.
constexpr int kH2oTile = 64, kH2oK = 32, kH2oRowTiles = 8;

struct H2oRowsArgs {
  const float* q;    // [T][nh*hd]
  const float* lse;  // [T][nh]
  float* part;       // [gridDim.y][n]
  KvLayer kv;
  int p0, T, nh, nkv, hd, ns;
  int groups;  // row groups per KV head: blockIdx.y = kvh * groups + group
  float scale;
};

template <int KVT>
__global__ void __launch_bounds__(256) h2o_rows_part_kernel(H2oRowsArgs a) {
  __shared__ float ks[kH2oK][kH2oTile + 1], qs[kH2oK][kH2oTile + 1], red[16][kH2oTile];
  const int n = a.p0 + a.T, hd = a.hd, row = a.nkv * hd, G = a.nh / a.nkv, R = a.T * G;
  const int kvh = blockIdx.y / a.groups, rg = blockIdx.y % a.groups, s0 = blockIdx.x * kH2oTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float tot = 0.f;  // thread i < 64: slot s0 + i over the row tiles so far
  for (int rt = 0; rt < kH2oRowTiles; ++rt) {
    const int r0 = (rg * kH2oRowTiles + rt) * kH2oTile;
    if (r0 >= R) break;
    // Rows are in token order: a tile whose last token sees none of the slots adds nothing.
    if (a.p0 + min(R - 1, r0 + kH2oTile - 1) / G < s0) continue;
    float d[4][4] = {};
    for (int k0 = 0; k0 < hd; k0 += kH2oK) {
      __syncthreads();  // the previous step's tiles are no longer read
      for (int i = threadIdx.x; i < kH2oTile * kH2oK; i += blockDim.x) {
        const int j = i / kH2oK, k = i % kH2oK;
        const int s = s0 + j, r = r0 + j;
        float v = 0.f, w = 0.f;
        if (s < n && k0 + k < hd) {
          v = kv_load<KVT>(a.kv.k, size_t(s) * row + size_t(kvh) * hd + k0 + k);
          if constexpr (KVT == KV_FP8) v *= a.kv.ks[size_t(s) * a.ns + (a.ns == 1 ? 0 : kvh)];
        }
        if (r < R && k0 + k < hd) w = a.q[(size_t(r / G) * a.nh + kvh * G + r % G) * hd + k0 + k];
        ks[k][j] = v;
        qs[k][j] = w;
      }
      __syncthreads();
#pragma unroll 8
      for (int k = 0; k < kH2oK; ++k) {
        float kk[4], qq[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) kk[j] = ks[k][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i) qq[i] = qs[k][ty + 16 * i];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) d[i][j] += qq[i] * kk[j];
      }
    }
    float col[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + ty + 16 * i;
      if (r >= R) continue;
      const int t = r / G;
      const float l = a.lse[size_t(t) * a.nh + kvh * G + r % G];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int s = s0 + tx + 16 * j;
        if (s < n && s <= a.p0 + t) col[j] += expf(d[i][j] * a.scale - l);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) red[ty][tx + 16 * j] = col[j];
    __syncthreads();
    if (threadIdx.x < kH2oTile)
      for (int y = 0; y < 16; ++y) tot += red[y][threadIdx.x];
  }
  if (threadIdx.x < kH2oTile && s0 + int(threadIdx.x) < n) a.part[size_t(blockIdx.y) * n + s0 + threadIdx.x] = tot;
}

// acc[s] += the parts of h2o_rows_part_kernel, in order (tova: acc[s] = them).
__global__ void h2o_rows_sum_kernel(KvLayer kv, const float* part, int parts, int n) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= n) return;
  float t = kv.latest_only ? 0.f : kv.acc[s];
  for (int p = 0; p < parts; ++p) t += part[size_t(p) * n + s];
  kv.acc[s] = t;
}

// A windowed cache takes the chunk's K/V after its queries ran: position
// p0 + t goes to its slot unless a later position of the chunk takes that
// slot (grid: T blocks). el: bytes per element.
__global__ void kv_commit_kernel(KvLayer kv, KvLayer stage, int p0, int T, int row, int ns, int el) {
  const int t = blockIdx.x, pos = p0 + t;
  const bool keep = pos < kv.sinks || pos + (kv.window - kv.sinks) >= p0 + T;
  if (!keep) return;
  const int slot = kv_slot(kv, pos);
  const size_t bytes = size_t(row) * el;
  const char* sk = static_cast<const char*>(stage.k) + size_t(t) * bytes;
  const char* sv = static_cast<const char*>(stage.v) + size_t(t) * bytes;
  char* dk = static_cast<char*>(kv.k) + size_t(slot) * bytes;
  char* dv = static_cast<char*>(kv.v) + size_t(slot) * bytes;
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dk[i] = sk[i], dv[i] = sv[i];
  if (int(threadIdx.x) < ns) {
    kv.ks[size_t(slot) * ns + threadIdx.x] = stage.ks[size_t(t) * ns + threadIdx.x];
    kv.vs[size_t(slot) * ns + threadIdx.x] = stage.vs[size_t(t) * ns + threadIdx.x];
  }
}

static __global__ void set_int_kernel(int* p, int v) { *p = v; }
static __global__ void fill_seq_kernel(int* p, int p0, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = p0 + i;
}

}  // namespace flashmoe::cuda
