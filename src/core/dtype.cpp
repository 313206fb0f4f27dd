#include "core/dtype.h"

namespace flashmoe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::I32: return 4;
    case DType::U32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::F8_E4M3: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::U32: return "U32";
    case DType::U8: return "U8";
    case DType::F8_E4M3: return "F8_E4M3";
  }
  return "?";
}

bool dtype_from_safetensors(const std::string& s, DType* out) {
  static const struct { const char* name; DType t; } table[] = {
      {"F32", DType::F32}, {"F16", DType::F16},   {"BF16", DType::BF16},
      {"I64", DType::I64}, {"I32", DType::I32},   {"U32", DType::U32},   {"U8", DType::U8},
      {"F8_E4M3", DType::F8_E4M3}};
  for (const auto& e : table)
    if (s == e.name) { *out = e.t; return true; }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000 | man << 13;
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  uint32_t absu = u & 0x7fffffff;
  if (absu > 0x7f800000) return uint16_t(sign | 0x7e00);
  if (absu >= 0x477ff000) return uint16_t(sign | 0x7c00);  // overflow -> inf
  if (absu < 0x38800000) {  // subnormal or zero in f16
    if (absu < 0x33000000) return uint16_t(sign);
    uint32_t e = absu >> 23;
    uint32_t m = (absu & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e;  // 113 - e + 13
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t r = absu + 0xfff + ((absu >> 13) & 1);
  return uint16_t(sign | ((r - 0x38000000) >> 13));
}

}  // namespace flashmoe
