// XXH64 (Yann Collet's xxHash, 64-bit variant), written out here so that the
// packed-expert checksums need no extra library. Several GB/s per core, so
// verifying every expert read from disk costs little next to the read.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashmoe {

uint64_t xxhash64(const void* data, size_t len, uint64_t seed = 0);

}  // namespace flashmoe
