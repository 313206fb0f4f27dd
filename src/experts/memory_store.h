// In-memory expert stores: views straight into mmapped weights, no copies.
#pragma once
#include <memory>
#include <vector>

#include "experts/expert_store.h"
#include "experts/manifest.h"

namespace flashmoe {

// The routed experts of a plain HF checkpoint, per layer: layers[i] points at
// layer i's experts ([E], views into the mmapped checkpoint; empty for a layer
// without routed experts).
using LayerExpertViews = std::vector<const std::vector<FfnExpert>*>;

// Experts of a plain HF checkpoint (already views, which must outlive the store).
std::unique_ptr<ExpertStore> make_weights_store(LayerExpertViews layers, uint64_t expert_bytes);
// Experts of a packed directory, mmapped; each expert's checksum is verified
// the first time it is used.
std::unique_ptr<ExpertStore> make_mmap_packed_store(const PackedManifest& m);

}  // namespace flashmoe
