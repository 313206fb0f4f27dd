// Run-time CPU feature detection for the kernels with vector paths (core/simd,
// core/matrix_rows, kv/kv_kernels): each such kernel is compiled with a target
// attribute and chosen here at run time, so one binary runs on any x86-64 and
// uses the widest instruction level the CPU has.
#pragma once

namespace flashmoe {

// The instruction levels the CPU kernels are written for, lowest first.
//   Portable: plain C++ (any CPU).
//   Avx2:     AVX2 + FMA + F16C.
//   Avx512:   Avx2 plus AVX-512 F/BW/VL/DQ.
//   Avx512Vnni: Avx512 plus AVX512-VNNI (vpdpbusd: the int8 dot products of
//             the q8 / q4 decode rows).
enum class CpuLevel { Portable = 0, Avx2 = 1, Avx512 = 2, Avx512Vnni = 3 };

const char* cpu_level_name(CpuLevel level);

// The widest level this CPU (and OS) supports. Always Portable off x86.
CpuLevel cpu_level_supported();

// The level the kernels use: the supported one, or the lower one named by
// FLASHMOE_CPU_LEVEL=portable|avx2|avx512|avx512vnni (to test or compare the narrower
// paths on a wide machine). Read once, on the first call; a value that is not
// a level name, or a level above what the CPU supports, throws Error naming
// the variable.
CpuLevel cpu_level();

// cpu_level() >= Avx2.
inline bool avx2_available() { return cpu_level() >= CpuLevel::Avx2; }

}  // namespace flashmoe
