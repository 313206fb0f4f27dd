// Device helpers shared by every CUDA kernel: reductions, programmatic
// dependent launch, streaming 16-byte loads and the dots built on them, the
// normed copy of x into shared memory. All math in fp32; weights are read in
// their storage type (float, __half, __nv_bfloat16) with 16-byte loads.
// Kernels that are not templates are static in every header: several
// translation units (the decode step, the prefill, the benchmarks) include them.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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
// The warp's largest value and its index (the lowest index among equal
// values, as the CPU's argmax and top-k pick), left in every lane.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) {
      bv = ov;
      bi = oi;
    }
  }
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
// The index of the largest of v[0, n) over the block (ties: the lower
// index, as core/argmax.h; all NaN: 0), left in every lane of warp 0.
// 16-byte loads, eight in flight per thread (one thread per element was a
// chain of n / blockDim dependent rounds); indices still rise per thread.
__device__ __forceinline__ int block_argmax(const float* __restrict__ v, int n) {
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  auto take = [&](float x, int i) {
    if (x > bv) {
      bv = x;
      bi = i;
    }
  };
  const int n4 = (reinterpret_cast<uintptr_t>(v) % 16 == 0) ? n / 4 : 0;
  const float4* v4 = reinterpret_cast<const float4*>(v);
#pragma unroll 8
  for (int i = threadIdx.x; i < n4; i += blockDim.x) {
    const float4 x = v4[i];
    take(x.x, 4 * i);
    take(x.y, 4 * i + 1);
    take(x.z, 4 * i + 2);
    take(x.w, 4 * i + 3);
  }
  for (int i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) take(v[i], i);
  __shared__ float sv[32];
  __shared__ int si[32];
  warp_argmax(bv, bi);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) {
    sv[w] = bv;
    si[w] = bi;
  }
  __syncthreads();
  if (w == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    bv = l < nw ? sv[l] : -INFINITY;
    bi = l < nw ? si[l] : 0x7fffffff;
    warp_argmax(bv, bi);
  }
  return bi == 0x7fffffff ? 0 : bi;
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
// 16 bytes global -> shared without a register (cp.async; both 16-byte
// aligned), the thread's copies so far made one group, and the wait until
// at most N of its groups are pending (which makes a thread's own copies
// of the others visible to it).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}
// The same, or 16 zero bytes where !ok (src unread, but a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int n = ok ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Until *count >= n (acquire: what the adders stored before their fence is
// visible to this block after its barrier). Past a second the count will
// not come (a broken launch): trap rather than hang the device.
__device__ __forceinline__ void wait_count(const int* count, int n) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
    if (v >= n) return;
    __nanosleep(64);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 1000000000ull) __trap();
  }
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

// 8 bytes (fp8_rows.cuh: a lane's 8 codes of a chunk).
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 r;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
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

}  // namespace flashmoe::cuda
