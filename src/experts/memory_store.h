// In-memory expert stores: views straight into mmapped weights, no copies.
#pragma once
#include <memory>

#include "experts/expert_store.h"
#include "experts/manifest.h"

namespace flashmoe {

// Experts of a plain HF checkpoint (already views in `w`, which must outlive it).
std::unique_ptr<ExpertStore> make_weights_store(const ModelWeights& w, uint64_t expert_bytes);
// Experts of a packed directory, mmapped; each expert's checksum is verified
// the first time it is used.
std::unique_ptr<ExpertStore> make_mmap_packed_store(const PackedManifest& m);

}  // namespace flashmoe
