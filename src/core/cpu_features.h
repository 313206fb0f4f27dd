// Run-time CPU feature detection for the kernels with an AVX2 path (core/simd,
// core/matrix_rows, kv/kv_kernels): each such kernel is compiled with a target
// attribute and chosen here at run time, so one binary runs on any x86-64.
#pragma once

namespace flashmoe {

// Whether the AVX2 + FMA + F16C kernels are in use: the CPU has all three and
// FLASHMOE_NO_AVX2 is unset (FLASHMOE_NO_AVX2=1 forces the portable kernels,
// to test them on AVX2 machines). Read once, on the first call. Always false
// off x86.
bool avx2_available();

}  // namespace flashmoe
