// What the router's top-k records for the tiered expert cache (shared by the
// kernels and ExpertTiers, which owns the arrays).
#pragma once

namespace flashmoe::cuda {

// Per-layer expert accounting of the tiered expert cache (null when off).
struct TierCount {
  unsigned* counts;          // [E] times each expert was chosen
  const int* tier;           // [E] where it is read from: 0 VRAM, 1 pinned host memory
  unsigned long long* hits;  // [2] choices served per tier (all layers)
};

}  // namespace flashmoe::cuda
