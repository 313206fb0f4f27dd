// Random FP8 data on the device for the FP8 micro benches
// (fp8_matvec_bench.cu, fp8_experts_bench.cu), the host's exact E4M3
// decode for their double-precision references, and a CUDA error check.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace flashmoe::micro {

__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__host__ __device__ inline float unit(uint64_t h) { return float(h >> 40) * (1.0f / 16777216.0f); }  // [0, 1)

// A random E4M3 code, never NaN (0x7f / 0xff): exponent field 4..11
// (|value| 2^-3 .. 30), any mantissa, either sign.
__host__ __device__ inline uint8_t rand_code(uint64_t h) {
  const uint32_t s = uint32_t(h) & 0x80u, e = 4u + ((uint32_t(h) >> 8) & 7u), m = (uint32_t(h) >> 16) & 7u;
  return uint8_t(s | (e << 3) | m);
}
// E4M3 code -> value (host reference; bias 7, subnormals 2^-9 m).
inline double e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}

__global__ void gen_codes(uint8_t* w, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    w[i] = rand_code(mix64(seed ^ (i * 0x2545f4914f6cdd1dull)));
}
// Positive block scales, scale x [0.5, 1.5).
__global__ void gen_scales(float* s, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    s[i] = (0.5f + unit(mix64(seed ^ (i * 0x9e3779b97f4a7c15ull)))) * scale;
}

// The end of a read kernel: the warp's xor of what it read to out[block]
// after the PDL wait (the only write, so the next launch may start its
// loads as soon as this one's blocks finish theirs).
__device__ __forceinline__ void xor_out(uint32_t acc, uint32_t* out) {
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if ((threadIdx.x & 31) == 0) atomicXor(out + blockIdx.x, acc);
}

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace flashmoe::micro

#define CKB(x) ::flashmoe::micro::ck((x), #x)
