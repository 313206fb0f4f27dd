// The byte layout of one routed expert in a packed per-layer file: gate, up
// and down one after another (each: weights, then bf16 scales and biases when
// quantised; FP8 blocks: E4M3 codes, then the fp32 block scales), so a single
// read fetches the whole expert. Every expert of a
// model has the same layout; only its offset in the file differs.
#pragma once
#include <cstdint>
#include <string>

#include "core/matrix.h"
#include "experts/ffn_expert.h"

namespace flashmoe {

// Expert records start on this boundary in the file (page and O_DIRECT friendly).
constexpr uint64_t kExpertAlign = 4096;

struct ExpertPart {
  int64_t rows = 0, cols = 0;
  uint64_t offset = 0, bytes = 0;            // weights
  uint64_t scales = 0, biases = 0;           // offsets (quantised only; fp8: scales only)
};

struct ExpertLayout {
  QuantKind quant = QuantKind::None;  // None: bf16
  int32_t group = 0;       // fp8: block columns
  int32_t block_rows = 0;  // fp8 only
  ExpertPart gate, up, down;
  uint64_t bytes = 0;  // the whole record

  // Layout for hidden size H, expert intermediate size I. Throws Error if the
  // group does not divide H and I (q8 / q4) or a block size is not positive (fp8).
  static ExpertLayout make(int64_t H, int64_t I, QuantKind quant, int32_t group, int32_t block_rows = 0);
  // Views of an expert record starting at `base` (valid while base is).
  FfnExpert views(const uint8_t* base) const;
  std::string format_name() const;  // "bf16", "q8", "q4", "fp8"
};

inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Parses "bf16" / "q8" / "q4" / "fp8"; throws Error naming `what` otherwise.
QuantKind parse_expert_format(const std::string& s, const std::string& what);

}  // namespace flashmoe
