// How one session stores and retains the keys and values of its
// full-attention layers. Fixed when the session is created.
#pragma once
#include <cstdint>
#include <string>

namespace flashmoe {

enum class KvDType { F32, BF16, F16, FP8 };
enum class Fp8ScaleMode { Position, Head };

struct KvConfig {
  KvDType dtype = KvDType::F32;
  Fp8ScaleMode fp8_scale = Fp8ScaleMode::Position;
  int64_t window = 0;       // > 0: sliding window of this many positions
  int64_t h2o_budget = 0;   // > 0: heavy-hitter retention with this budget (wins over window)
  int64_t sinks = 4;        // h2o / streaming: first positions always kept
  double recent_fraction = 0.25;  // h2o: share of the budget kept for the most recent positions
  bool fp8_scale_set = false;     // --kv-fp8-scale given explicitly (an error without fp8)

  // Throws Error with a clear message for an impossible combination.
  void validate() const;
  std::string describe() const;
};

const char* kv_dtype_name(KvDType t);

}  // namespace flashmoe
