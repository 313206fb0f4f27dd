// The per-level kernel tables behind core/simd.h, each defined in the
// translation unit that holds that level's code (simd.cpp: portable and AVX2;
// simd_avx512.cpp: AVX-512). Internal to core/.
#pragma once
#include "core/simd.h"

namespace flashmoe::cpu::simd {

extern const Kernels kPortableKernels;
#if defined(__x86_64__) || defined(__i386__)
extern const Kernels kAvx2Kernels;
extern const Kernels kAvx512Kernels;
#endif

// The portable scalar read of element i of a float-typed row (throws Error
// for other types): the tails of the vector kernels use it.
float scalar_at(DType t, const void* p, int64_t i);

// silu_mul with std::exp (the portable and avx2 levels, and tails).
void silu_mul_scalar(float* g, const float* u, int64_t n);

}  // namespace flashmoe::cpu::simd
