// Element types found in checkpoints and the scalar conversions between them.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace flashmoe {

enum class DType { F32, F16, BF16, I64, I32, U32, U8, F8_E4M3 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses a safetensors dtype string ("BF16", "F32", ...); false if unknown.
bool dtype_from_safetensors(const std::string& s, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even, NaN kept quiet.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace flashmoe
