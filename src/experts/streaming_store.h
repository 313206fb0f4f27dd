// The streaming expert store: the router's picks are pread from the packed
// per-layer files by a pool of I/O threads into a bounded cache. Each read is
// checked against the manifest's XXH64 before use, so a corrupt or short
// read is an Error, never silently used.
#pragma once
#include <memory>

#include "experts/expert_store.h"
#include "experts/manifest.h"

namespace flashmoe {

std::unique_ptr<ExpertStore> make_streaming_store(const PackedManifest& m, uint64_t cache_bytes, CachePolicy policy,
                                                  int io_threads, bool direct_io);

}  // namespace flashmoe
