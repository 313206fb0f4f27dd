#include "core/cpu_features.h"

#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FLASHMOE_X86 1
#endif

namespace flashmoe {

bool avx2_available() {
#ifdef FLASHMOE_X86
  // F16C is read from CPUID directly: clang before 15 rejects
  // __builtin_cpu_supports("f16c").
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  }() && !std::getenv("FLASHMOE_NO_AVX2");
  return ok;
#else
  return false;
#endif
}

}  // namespace flashmoe
