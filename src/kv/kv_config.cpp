#include "kv/kv_config.h"

#include "core/error.h"

namespace flashmoe {

const char* kv_dtype_name(KvDType t) {
  switch (t) {
    case KvDType::F32: return "f32";
    case KvDType::BF16: return "bf16";
    case KvDType::F16: return "f16";
    case KvDType::FP8: return "fp8";
  }
  return "?";
}

void KvConfig::validate() const {
  if (window < 0) fail("--kv-window must be positive");
  if (h2o_budget < 0) fail("--kv-h2o must be positive");
  if (fp8_scale_set && dtype != KvDType::FP8) fail("--kv-fp8-scale needs --kv-dtype fp8");
}

std::string KvConfig::describe() const {
  std::string s = std::string("dtype=") + kv_dtype_name(dtype);
  if (h2o_budget > 0) s += " h2o=" + std::to_string(h2o_budget);
  else if (window > 0) s += " window=" + std::to_string(window);
  else s += " full";
  return s;
}

}  // namespace flashmoe
