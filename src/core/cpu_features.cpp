#include "core/cpu_features.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FLASHMOE_X86 1
#endif

namespace flashmoe {

const char* cpu_level_name(CpuLevel level) {
  switch (level) {
    case CpuLevel::Portable: return "portable";
    case CpuLevel::Avx2: return "avx2";
    case CpuLevel::Avx512: return "avx512";
    case CpuLevel::Avx512Vnni: return "avx512vnni";
  }
  return "?";
}

namespace {

CpuLevel detect() {
#ifdef FLASHMOE_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  // F16C is read from CPUID directly: clang before 15 rejects
  // __builtin_cpu_supports("f16c").
  const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)) return CpuLevel::Portable;
  // __builtin_cpu_supports("avx512f") also checks that the OS saves the ZMM
  // state (XCR0).
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!avx512) return CpuLevel::Avx2;
  return __builtin_cpu_supports("avx512vnni") ? CpuLevel::Avx512Vnni : CpuLevel::Avx512;
#else
  return CpuLevel::Portable;
#endif
}

CpuLevel from_environment() {
  const CpuLevel supported = cpu_level_supported();
  const char* v = std::getenv("FLASHMOE_CPU_LEVEL");
  if (!v || !*v) return supported;
  const std::string s(v);
  for (CpuLevel l : {CpuLevel::Portable, CpuLevel::Avx2, CpuLevel::Avx512, CpuLevel::Avx512Vnni}) {
    if (s != cpu_level_name(l)) continue;
    if (l > supported)
      fail("FLASHMOE_CPU_LEVEL=" + s + " but this CPU supports at most '" + cpu_level_name(supported) + "'");
    return l;
  }
  fail("FLASHMOE_CPU_LEVEL='" + s + "' is not one of portable, avx2, avx512, avx512vnni");
}

}  // namespace

CpuLevel cpu_level_supported() {
  static const CpuLevel level = detect();
  return level;
}

CpuLevel cpu_level() {
  static const CpuLevel level = from_environment();
  return level;
}

}  // namespace flashmoe
