// Attention of the full-attention layers at decode: attn_prep (q/k norm,
// partial rotary, the new position into the KV cache in its storage type)
// and attn (scores, softmax, weighted values, output gate), every KV format
// (FP8 decoded inline with its per-position / per-head scales), every
// retention policy (h2o: the victim picked in attn_prep, the scores summed
// by h2o_acc_kernel; quest: the positions quest.cuh chose).
#pragma once
#include <cooperative_groups.h>

#include <array>
#include <climits>
#include <cmath>

#include "backend/cuda/device_model.cuh"
#include "backend/cuda/common.cuh"
#include "format/config.h"

namespace flashmoe::cuda {

// KV storage element types.
enum KvT { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_FP8 = 3 };

struct KvLayer {
  void* k;      // [cap][nkv][hd] elements
  void* v;
  float* ks;    // fp8 scales [cap][ns]
  float* vs;
  int cap;      // slots allocated
  int window;   // 0: full / h2o; else the circular window W (streaming: W with sinks)
  int sinks;    // streaming, h2o: first positions kept; 0 otherwise
  // h2o (heavy hitters, budget cap): the slots are not in chronological
  // order. A new position takes the next free slot, then, once all cap are
  // full, the slot of the position it evicts (attn_prep picks it); kpos
  // says which position each slot holds. Same victims as the CPU's KvCache,
  // which keeps its slots in order instead (it shifts them down).
  float* acc = nullptr;  // accumulated attention per slot (h2o_acc_kernel); null: not h2o
  int* kpos = nullptr;   // position held by each slot
  int recent = 0;        // the last `recent` positions (the new one included) are never evicted
  // tova: acc holds the latest query's probabilities (summed over heads),
  // overwritten by every step instead of accumulated (same eviction as h2o).
  int latest_only = 0;
  // snapkv after the prompt was cut to cap = B positions: a streaming
  // layout (window B, sinks B - R: the kept prompt positions, then a ring of
  // R) over positions counted from `shift` (the prompt positions dropped).
  int shift = 0;
  // fp8 `rotated`: K and V stored as H k, H v per head (H the orthonormal
  // Hadamard matrix, its own inverse). q.k = (Hq).(Hk), so attn_prep
  // rotates the query too; the attention's output is in the rotated basis
  // and rot_gate_kernel rotates it back (and gates it).
  int rot = 0;
  // quest (--kv-resident N, quest.cuh): stored as `full` (slot = position);
  // pages of qpage slots, each with the per-channel minimum and maximum of
  // its decoded keys per KV head; each query attends over the pages
  // quest_select_kernel chose for its KV head (qsel, qn) instead of [0, n).
  int quest = 0;         // N, the positions one query reads at most (0: not quest)
  int qpage = 0;         // P
  int qrecent = 0;       // floor(F x N) with --kv-recent F, else 0 (the newest page alone)
  int qlayer = 0;        // one choice per layer (all query heads' bounds) instead of per KV head
  int qpcap = 0;         // pages the bounds hold: the pitch of kmin / kmax / qub
  int qmaxp = 0;         // pages one choice holds at most: the pitch of qsel
  float* kmin = nullptr;  // [nkv][hd][qpcap]: page-minor, so a warp reads 32 pages' channel c at once
  float* kmax = nullptr;
  float* qub = nullptr;   // [nkv][qpcap]: the pages' bounds for the current query
  int* qsel = nullptr;    // [nkv][qmaxp]: the chosen pages, ascending
  int* qn = nullptr;      // [nkv]: the positions they hold
};

// Every device buffer a KvLayer owns (null where its policy has none).
inline std::array<void*, 11> kv_layer_buffers(const KvLayer& l) {
  return {l.k, l.v, l.ks, l.vs, l.acc, l.kpos, l.kmin, l.kmax, l.qub, l.qsel, l.qn};
}

// quest: the slot of the i-th position a query of KV head kvh reads (the
// chosen pages are whole but the newest, so i / P indexes them).
__device__ __forceinline__ int quest_slot(const KvLayer& L, int kvh, int i) {
  return L.qsel[kvh * L.qmaxp + i / L.qpage] * L.qpage + i % L.qpage;
}

// x <- H x in shared memory (n a power of two; every thread of the block
// calls it after x is written): the butterflies of the CPU's
// kv_kernels::hadamard_ortho, stage by stage, then the 1/sqrt(n) scale, so
// the same bits.
__device__ __forceinline__ void hadamard_smem(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int i = (p / h) * 2 * h + p % h;
      const float a = x[i], b = x[i + h];
      x[i] = a + b;
      x[i + h] = a - b;
    }
    __syncthreads();
  }
  const float s = 1.0f / sqrtf(float(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] *= s;
  __syncthreads();
}

// The slot of position pos in a full / window / streaming cache (not h2o).
__device__ __forceinline__ int kv_slot(const KvLayer& L, int pos) {
  if (L.window == 0) return pos;
  pos -= L.shift;
  if (L.sinks == 0) return pos % L.window;
  return pos < L.sinks ? pos : L.sinks + (pos - L.sinks) % (L.window - L.sinks);
}
__device__ __forceinline__ int kv_valid(const KvLayer& L, int pos) {  // after appending pos
  if (L.acc) return min(pos + 1, L.cap);
  return L.window == 0 ? pos + 1 : min(pos + 1 - L.shift, L.window);
}

// h2o: the slot position pos goes to (the whole block calls it; the same
// answer in every thread). A free one while the cache fills up; then the
// victim: of the positions held, not one of the first `sinks` nor of the
// last recent - 1 (those are always held: they were protected at every
// eviction since they arrived), the one with the lowest accumulated score,
// the oldest of equal ones. Its score restarts at 0 for the newcomer.
__device__ __forceinline__ int h2o_pick(const KvLayer& L, int pos) {
  if (pos < L.cap) return pos;
  __shared__ float best_v[32];
  __shared__ int best_p[32], best_s[32];
  float v = INFINITY;
  int p = INT_MAX, slot = -1;
  auto consider = [&](int ps, float a, int s) {
    if (ps < L.sinks || ps > pos - L.recent) return;
    if (a < v || (a == v && ps < p)) v = a, p = ps, slot = s;
  };
  // 16-byte loads, kU per thread issued together: one memory latency per
  // kU * 4 * blockDim slots instead of one per blockDim (the scan is on
  // the decode step's critical path).
  constexpr int kU = 4;
  const int n4 = L.cap % 4 == 0 ? L.cap / 4 : 0;
  for (int i0 = threadIdx.x; i0 < n4; i0 += kU * blockDim.x) {
    int4 kp[kU];
    float4 ac[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * blockDim.x;
      kp[u] = i < n4 ? reinterpret_cast<const int4*>(L.kpos)[i] : make_int4(-1, -1, -1, -1);
      ac[u] = i < n4 ? reinterpret_cast<const float4*>(L.acc)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = 4 * (i0 + u * blockDim.x);
      consider(kp[u].x, ac[u].x, s);
      consider(kp[u].y, ac[u].y, s + 1);
      consider(kp[u].z, ac[u].z, s + 2);
      consider(kp[u].w, ac[u].w, s + 3);
    }
  }
  for (int s = 4 * n4 + threadIdx.x; s < L.cap; s += blockDim.x) consider(L.kpos[s], L.acc[s], s);
  // Lexicographic (score, position) minimum over the warp, then the warps.
  auto better = [](float a, int pa, float b, int pb) { return a < b || (a == b && pa < pb); };
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int op = __shfl_xor_sync(0xffffffffu, p, o), os = __shfl_xor_sync(0xffffffffu, slot, o);
    if (better(ov, op, v, p)) v = ov, p = op, slot = os;
  }
  const int warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0) best_v[warp] = v, best_p[warp] = p, best_s[warp] = slot;
  __syncthreads();
  v = best_v[0], p = best_p[0], slot = best_s[0];
  for (int w = 1; w < nw; ++w)
    if (better(best_v[w], best_p[w], v, p)) v = best_v[w], p = best_p[w], slot = best_s[w];
  __syncthreads();  // every thread has read kpos / acc and the partials
  return slot;
}

struct AttnPrepArgs {
  const float* qkv;  // [2*nh*hd | nkv*hd (k) | nkv*hd (v)]
  const float* q_norm;
  const float* k_norm;
  const float* inv_freq;  // [rd/2]
  float* q;               // [nh*hd] normed + rotated
  const int* pos;
  KvLayer kv;
  int nh, nkv, hd, rd, ns, kvt;
  float eps;
  // Batched prefill: blockIdx.y = token t of a chunk at position *pos + t,
  // its qkv row at qkv + t * tstride, its q at q + t * nh * hd.
  int tstride = 0;
  // >= 0: K/V of position p go to row p - stage of kv (a staging buffer of
  // the chunk, for a windowed cache: prefill.cu), not to its cache slot.
  int stage = -1;
};

// The rotation of this thread's pair i = threadIdx.x (i < rd/2) and the
// norm weights (1 + w) of its elements i = threadIdx.x + k * blockDim.x:
// neither depends on the previous kernel (weights, and the position from
// the last step), so attn_prep computes them before its wait. ok: the
// shapes fit (rd/2 <= blockDim.x, n <= kRopeNorm * blockDim.x).
constexpr int kRopeNorm = 4;
struct RopeNorm {
  float c = 1.f, s = 0.f, w[kRopeNorm];
  bool ok;
};
__device__ __forceinline__ void rope_norm_pre(RopeNorm& p, int rd, const float* inv_freq, int pos, const float* w,
                                              int n) {
  p.ok = rd / 2 <= int(blockDim.x) && n <= kRopeNorm * int(blockDim.x);
  if (!p.ok) return;
  if (int(threadIdx.x) < rd / 2) {
    const float f = float(pos) * inv_freq[threadIdx.x];
    p.c = float(cos(double(f)));
    p.s = float(sin(double(f)));
  }
#pragma unroll
  for (int k = 0; k < kRopeNorm; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    p.w[k] = i < n ? 1.0f + w[i] : 1.0f;
  }
}

__device__ __forceinline__ void rope_in_smem(float* x, int rd, const float* inv_freq, int pos, const RopeNorm& p) {
  const int half = rd / 2;
  if (p.ok) {
    if (int(threadIdx.x) < half) {
      const int i = threadIdx.x;
      const float a = x[i], b = x[i + half];
      x[i] = a * p.c - b * p.s;
      x[i + half] = b * p.c + a * p.s;
    }
    __syncthreads();
    return;
  }
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float f = float(pos) * inv_freq[i];
    const float c = float(cos(double(f))), s = float(sin(double(f)));
    const float a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
  __syncthreads();
}

__device__ __forceinline__ void norm_in_smem(float* x, const float* w, int n, float eps, const RopeNorm& p) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(n) + eps);
  if (p.ok) {
#pragma unroll
    for (int k = 0; k < kRopeNorm; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < n) x[i] = x[i] * r * p.w[k];
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = x[i] * r * (1.0f + w[i]);
  }
  __syncthreads();
}

__device__ __forceinline__ void kv_store(void* dst, size_t off, int kvt, float v, float scale) {
  switch (kvt) {
    case KV_F32: static_cast<float*>(dst)[off] = v; break;
    case KV_BF16: static_cast<__nv_bfloat16*>(dst)[off] = __float2bfloat16_rn(v); break;
    case KV_F16: static_cast<__half*>(dst)[off] = __float2half_rn(v); break;
    default:
      static_cast<uint8_t*>(dst)[off] = __nv_cvt_float_to_fp8(v / scale, __NV_SATFINITE, __NV_E4M3);
  }
}

// attn_prep_kernel's arguments for full-attention layer d: one token at
// *pos (decode), or a chunk when the caller sets tstride (and stage).
inline AttnPrepArgs attn_prep_args(const ModelConfig& c, const DLayer& d, const float* qkv, float* q, const int* pos,
                                   const float* inv_freq, const KvLayer& kv, int ns, int kvt) {
  AttnPrepArgs p;
  p.qkv = qkv;
  p.q_norm = d.q_norm;
  p.k_norm = d.k_norm;
  p.inv_freq = inv_freq;
  p.q = q;
  p.pos = pos;
  p.kv = kv;
  p.nh = int(c.num_heads);
  p.nkv = int(c.num_kv_heads);
  p.hd = int(c.head_dim);
  p.rd = int(c.rotary_dim);
  p.ns = ns;
  p.kvt = kvt;
  p.eps = c.rms_norm_eps;
  return p;
}

// Blocks 0..nh-1: q heads (norm + rope). Block nh: every KV head (k norm +
// rope, v), fp8 scales, store at the slot of this position.
// t: the token of a chunk (the prefill's blockIdx.y; 0 at decode).
__device__ __forceinline__ void attn_prep_body(AttnPrepArgs a, int t) {
  extern __shared__ float sm[];
  const int pos = *a.pos + t, hd = a.hd;
  a.qkv += size_t(t) * a.tstride;
  a.q += size_t(t) * a.nh * hd;
  RopeNorm pre;
  rope_norm_pre(pre, a.rd, a.inv_freq, pos, int(blockIdx.x) < a.nh ? a.q_norm : a.k_norm, hd);
  pdl_wait();
  pdl_trigger();
  if (blockIdx.x < a.nh) {
    const int h = blockIdx.x;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) sm[i] = a.qkv[h * 2 * hd + i];
    __syncthreads();
    norm_in_smem(sm, a.q_norm, hd, a.eps, pre);
    rope_in_smem(sm, a.rd, a.inv_freq, pos, pre);
    if (a.kv.rot) hadamard_smem(sm, hd);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) a.q[h * hd + i] = sm[i];
    return;
  }
  const int row = a.nkv * hd;
  float* kk = sm;
  float* vv = sm + row;
  __shared__ float scales[2][64];
  const float* kin = a.qkv + 2 * a.nh * hd;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    kk[i] = kin[i];
    vv[i] = kin[row + i];
  }
  __syncthreads();
  for (int h = 0; h < a.nkv; ++h) {
    norm_in_smem(kk + h * hd, a.k_norm, hd, a.eps, pre);
    rope_in_smem(kk + h * hd, a.rd, a.inv_freq, pos, pre);
  }
  if (a.kv.rot)
    for (int h = 0; h < a.nkv; ++h) {
      hadamard_smem(kk + h * hd, hd);
      hadamard_smem(vv + h * hd, hd);
    }
  if (a.kvt == KV_FP8) {
    const int block = row / a.ns;
    for (int b = 0; b < a.ns; ++b) {
      float mk = 0.f, mv = 0.f;
      for (int i = threadIdx.x; i < block; i += blockDim.x) {
        mk = fmaxf(mk, fabsf(kk[b * block + i]));
        mv = fmaxf(mv, fabsf(vv[b * block + i]));
      }
      mk = block_max(mk);
      mv = block_max(mv);
      if (threadIdx.x == 0) {
        scales[0][b] = mk > 0.f ? mk / 240.0f : 1.0f;
        scales[1][b] = mv > 0.f ? mv / 240.0f : 1.0f;
      }
    }
    __syncthreads();
  }
  const int slot = a.stage >= 0 ? pos - a.stage : a.kv.acc ? h2o_pick(a.kv, pos) : kv_slot(a.kv, pos);
  if (a.kv.acc && threadIdx.x == 0) {
    a.kv.kpos[slot] = pos;
    a.kv.acc[slot] = 0.f;
  }
  if (a.kvt == KV_FP8 && threadIdx.x < a.ns) {
    a.kv.ks[size_t(slot) * a.ns + threadIdx.x] = scales[0][threadIdx.x];
    a.kv.vs[size_t(slot) * a.ns + threadIdx.x] = scales[1][threadIdx.x];
  }
  const int block = a.ns > 0 ? row / a.ns : row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int b = a.ns > 0 ? i / block : 0;
    kv_store(a.kv.k, size_t(slot) * row + i, a.kvt, kk[i], a.kvt == KV_FP8 ? scales[0][b] : 1.f);
    kv_store(a.kv.v, size_t(slot) * row + i, a.kvt, vv[i], a.kvt == KV_FP8 ? scales[1][b] : 1.f);
  }
}

static __global__ void attn_prep_kernel(AttnPrepArgs a) { attn_prep_body(a, int(blockIdx.y)); }

template <int KVT>
__device__ __forceinline__ float kv_load(const void* p, size_t off) {
  if constexpr (KVT == KV_F32) return static_cast<const float*>(p)[off];
  else if constexpr (KVT == KV_BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[off]);
  else if constexpr (KVT == KV_F16) return __half2float(static_cast<const __half*>(p)[off]);
  else {
    __nv_fp8_e4m3 v;
    v.__x = static_cast<const uint8_t*>(p)[off];
    return float(v);
  }
}

// 8 consecutive elements from element offset off (a multiple of 8): one
// 32-, 16- or 8-byte load instead of 8 scalar ones (fp8 codes convert
// exactly, two at a time).
template <int KVT>
__device__ __forceinline__ void kv_load8(const void* p, size_t off, float* out) {
  if constexpr (KVT == KV_F32) {
    const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(p) + off);
    const float4 a = f[0], b = f[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else if constexpr (KVT == KV_FP8) {
    const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p) + off);
    const uint32_t u[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
          __nv_fp8x2_storage_t((u[i / 2] >> (16 * (i % 2))) & 0xffffu), __NV_E4M3);
      const float2 f = __half22float2(__half2(hr));
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + off);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (KVT == KV_BF16) {
        out[2 * i] = __uint_as_float(u[i] << 16);
        out[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      }
    }
  }
}

struct AttnArgs {
  const float* q;     // [nh*hd]
  const float* gate;  // qkv projection: gate of head h at h*2*hd + hd (null: ungated, for rot_gate_kernel)
  float* scores;      // scratch [nh][cap]
  float* out;         // [nh*hd]
  const int* pos;
  KvLayer kv;
  int nh, nkv, hd, ns;
  float scale;
  int prefetch;  // earlier positions' K/V rows into L2 before the wait (the decode step; 0 in the prefill's in-order attention)
  int split;     // blocks (a cluster) per query head, each a slice of the positions
};

// One query's attention arguments over the KV layer kv (the decode step,
// the batched step's rows, the prefill's in-order attention), with no L2
// prefetch and one block per head until the caller says otherwise.
inline AttnArgs attn_args(const ModelConfig& c, const float* q, const float* gate, float* scores, float* out,
                          const int* pos, const KvLayer& kv, int ns) {
  AttnArgs a;
  a.q = q;
  a.gate = gate;
  a.scores = scores;
  a.out = out;
  a.pos = pos;
  a.kv = kv;
  a.nh = int(c.num_heads);
  a.nkv = int(c.num_kv_heads);
  a.hd = int(c.head_dim);
  a.ns = ns;
  a.scale = 1.0f / std::sqrt(float(c.head_dim));
  a.prefetch = 0;
  a.split = 1;
  return a;
}

// Blocks per query head: split (a cluster of that many blocks, 1..8), each
// taking one slice of the positions with its own running max, sum and
// weighted values; the cluster combines them through distributed shared
// memory (flash-decoding). One block per head leaves 16 SMs to stream a
// long context's K/V (the 35B); split 1 is the plain softmax.
// Shared memory: q [hd], partial sums [max(8, 256/hd)][hd], acc [hd].
template <int KVT>
__device__ __forceinline__ void attn_body(const AttnArgs& a) {
  extern __shared__ float sm[];
  __shared__ float ml[2];  // this block's max and sum
  const int P = a.split, h = blockIdx.x / P, b = blockIdx.x % P;
  const int hd = a.hd, group = a.nh / a.nkv, kvh = h / group;
  const bool quest = a.kv.quest > 0;
  int n = quest ? 0 : kv_valid(a.kv, *a.pos);
  const int row = a.nkv * hd;
  int chunk = (n + P - 1) / P, s_beg = min(n, b * chunk), s_end = min(n, s_beg + chunk);
  // quest: the i-th position read is in slot quest_slot(i), chosen by the
  // kernel just before (so nothing to prefetch before the wait).
  auto slot_of = [&](int i) { return quest ? quest_slot(a.kv, kvh, i) : i; };
  if (a.prefetch && !quest) {
    // The rows of earlier positions (complete since the last step) into L2
    // before the wait, shared out over the blocks of this KV head; only the
    // current position's row comes from attn_prep.
    const size_t bytes = size_t(hd) * (KVT == KV_F32 ? 4 : KVT == KV_FP8 ? 1 : 2);
    const int lines = int((bytes + 127) / 128), len = s_end - s_beg;
    const int self = a.kv.acc ? -1 : kv_slot(a.kv, *a.pos);  // h2o: not known before attn_prep
    for (int t = (h % group) * blockDim.x + threadIdx.x; t < len * lines; t += group * blockDim.x) {
      const int s = s_beg + t / lines;
      if (s == self) continue;
      const size_t off = (size_t(s) * row + size_t(kvh) * hd) * bytes / hd + size_t(t % lines) * 128;
      prefetch_l2(static_cast<const char*>(a.kv.k) + off);
      prefetch_l2(static_cast<const char*>(a.kv.v) + off);
    }
  }
  pdl_wait();
  pdl_trigger();
  if (quest) {
    n = a.kv.qn[kvh];
    chunk = (n + P - 1) / P, s_beg = min(n, b * chunk), s_end = min(n, s_beg + chunk);
  }
  float* q = sm;
  float* part = sm + hd;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  float* acc_out = part + max(nw, int(blockDim.x) / hd) * hd;
  float* sc = a.scores + size_t(h) * a.kv.cap;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) q[i] = a.q[h * hd + i];
  __syncthreads();
  float mx = -INFINITY;
  // kU positions per warp at once: their loads in flight together (the
  // chain of dependent rounds per warp is kU times shorter); each score sums
  // in the same order as one at a time.
  constexpr int kU = 4;
  // vec: a lane takes 8 consecutive dims (one wide load per position).
  const bool vec = hd % 8 == 0 && hd <= 256;
  for (int s0 = s_beg + warp; s0 < s_end; s0 += kU * nw) {
    float d[kU], ksc[kU];
    size_t off[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = slot_of(min(s0 + u * nw, s_end - 1));
      d[u] = 0.f;
      off[u] = size_t(s) * row + size_t(kvh) * hd;
      ksc[u] = 1.f;
      if constexpr (KVT == KV_FP8) ksc[u] = a.kv.ks[size_t(s) * a.ns + (a.ns == 1 ? 0 : kvh)];  // with the K loads
    }
    if (vec) {
      if (lane * 8 < hd) {
        float kv[kU][8];
#pragma unroll
        for (int u = 0; u < kU; ++u) kv_load8<KVT>(a.kv.k, off[u] + lane * 8, kv[u]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float qj = q[lane * 8 + j];
#pragma unroll
          for (int u = 0; u < kU; ++u) d[u] += qj * kv[u][j];
        }
      }
    } else {
#pragma unroll 2
      for (int i = lane; i < hd; i += 32) {
        const float qi = q[i];
#pragma unroll
        for (int u = 0; u < kU; ++u) d[u] += qi * kv_load<KVT>(a.kv.k, off[u] + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = s0 + u * nw;
      float e = warp_sum(d[u]);
      if (s >= s_end) break;
      if constexpr (KVT == KV_FP8) e *= ksc[u];
      e *= a.scale;
      if (lane == 0) sc[s] = e;
      mx = fmaxf(mx, e);
    }
  }
  mx = block_max(mx);
  float sum = 0.f;
  for (int s = s_beg + int(threadIdx.x); s < s_end; s += blockDim.x) {
    const float e = expf(sc[s] - mx);
    sc[s] = e;
    sum += e;
  }
  sum = block_sum(sum);  // also orders the sc writes before the reads below
  if (vec) {
    // Weighted values: each warp takes every nw-th position (several at
    // once), a lane 8 consecutive dims; partials per warp summed below.
    // (One thread per dim over all positions was a chain of n dependent
    // rounds per thread.)
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    if (lane * 8 < hd) {
#pragma unroll 4
      for (int s = s_beg + warp; s < s_end; s += nw) {
        const float p = sc[s];
        const int slot = slot_of(s);
        float vs = 1.f;
        if constexpr (KVT == KV_FP8) vs = a.kv.vs[size_t(slot) * a.ns + (a.ns == 1 ? 0 : kvh)];
        float v[8];
        kv_load8<KVT>(a.kv.v, size_t(slot) * row + size_t(kvh) * hd + lane * 8, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if constexpr (KVT == KV_FP8) v[i] *= vs;
          acc[i] += p * v[i];
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) part[warp * hd + lane * 8 + i] = acc[i];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      float t = 0.f;
      for (int w = 0; w < nw; ++w) t += part[w * hd + d];
      acc_out[d] = t;
    }
  } else {  // P == 1 only (the host's choice)
    const int groups = blockDim.x / hd > 0 ? blockDim.x / hd : 1;
    const int grp = threadIdx.x / hd;
    for (int d = threadIdx.x % hd; d < hd && grp < groups; d += blockDim.x) {
      float acc = 0.f;
#pragma unroll 8
      for (int s = grp; s < n; s += groups) {
        const int slot = slot_of(s);
        float v = kv_load<KVT>(a.kv.v, size_t(slot) * row + size_t(kvh) * hd + d);
        if constexpr (KVT == KV_FP8) v *= a.kv.vs[size_t(slot) * a.ns + (a.ns == 1 ? 0 : kvh)];
        acc += sc[s] * v;
      }
      part[grp * hd + d] = acc;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      float t = 0.f;
      for (int g = 0; g < groups; ++g) t += part[g * hd + d];
      acc_out[d] = t;
    }
  }
  if (P == 1) {
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
      a.out[h * hd + d] = acc_out[d] / sum * (a.gate ? sigmoidf_(a.gate[h * 2 * hd + hd + d]) : 1.f);
    // h2o: the probabilities for h2o_acc_kernel (sc was last read before
    // the __syncthreads of the partial sums).
    if (a.kv.acc)
      for (int s = threadIdx.x; s < n; s += blockDim.x) sc[s] /= sum;
    return;
  }
  // Combine the cluster's slices: out = sum_b acc_b e^(m_b - M) / sum_b l_b e^(m_b - M),
  // every block the same sums in rank order, each writing its share of the dims.
  if (threadIdx.x == 0) ml[0] = mx, ml[1] = sum;
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  cl.sync();
  float M = -INFINITY;
  for (int r = 0; r < P; ++r) M = fmaxf(M, cl.map_shared_rank(ml, r)[0]);
  float L = 0.f;
  for (int r = 0; r < P; ++r) {
    const float* o = cl.map_shared_rank(ml, r);
    if (o[1] > 0.f) L += o[1] * expf(o[0] - M);
  }
  const int per = (hd + P - 1) / P;
  for (int d = b * per + int(threadIdx.x); d < min(hd, (b + 1) * per); d += blockDim.x) {
    float t = 0.f;
    for (int r = 0; r < P; ++r) {
      const float* o = cl.map_shared_rank(ml, r);
      if (o[1] > 0.f) t += cl.map_shared_rank(acc_out, r)[d] * expf(o[0] - M);
    }
    a.out[h * hd + d] = t / L * (a.gate ? sigmoidf_(a.gate[h * 2 * hd + hd + d]) : 1.f);
  }
  if (a.kv.acc) {  // h2o: this slice's probabilities, as in P == 1
    const float f = expf(mx - M) / L;
    for (int s = s_beg + int(threadIdx.x); s < s_end; s += blockDim.x) sc[s] *= f;
  }
  cl.sync();  // no block leaves while another still reads its shared memory
}

template <int KVT>
__global__ void __launch_bounds__(256) attn_kernel(AttnArgs a) {
  attn_body<KVT>(a);
}

// h2o: every held slot's score += its probability under each query head,
// heads in order (the CPU's order of additions); tova: the score is set to
// that sum (from 0, same order). scores: [nh][cap] from attn_kernel. One
// thread per slot.
__device__ __forceinline__ void h2o_acc_body(const KvLayer& kv, const float* scores, int nh, const int* pos) {
  pdl_wait();
  pdl_trigger();
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= kv_valid(kv, *pos)) return;
  float a = kv.latest_only ? 0.f : kv.acc[s];
  int h = 0;
  for (; h + 8 <= nh; h += 8) {  // 8 loads in flight, added in head order
    float p[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = scores[size_t(h + j) * kv.cap + s];
#pragma unroll
    for (int j = 0; j < 8; ++j) a += p[j];
  }
  for (; h < nh; ++h) a += scores[size_t(h) * kv.cap + s];
  kv.acc[s] = a;
}
static __global__ void h2o_acc_kernel(KvLayer kv, const float* scores, int nh, const int* pos) {
  h2o_acc_body(kv, scores, nh, pos);
}

// fp8 `rotated` (KvLayer::rot): each head's attention output, written
// ungated in the rotated basis, rotated back (H is its own inverse) and
// gated, as the CPU does. grid: nh x T (token t's row at out + t * nh * hd,
// its qkv row at gate + t * gstride); hd floats of shared memory.
static __global__ void rot_gate_kernel(float* out, const float* gate, int gstride, int nh, int hd) {
  extern __shared__ float sm[];
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x, t = blockIdx.y;
  float* o = out + (size_t(t) * nh + h) * hd;
  const float* g = gate + size_t(t) * gstride + size_t(h) * 2 * hd + hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) sm[i] = o[i];
  __syncthreads();
  hadamard_smem(sm, hd);
  for (int i = threadIdx.x; i < hd; i += blockDim.x) o[i] = sm[i] * sigmoidf_(g[i]);
}

}  // namespace flashmoe::cuda
