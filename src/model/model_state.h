// Everything that changes as one conversation advances: the position, the KV
// caches of the full-attention layers, and the GatedDeltaNet recurrent and
// conv states of the linear-attention layers. Copyable, so a server can
// snapshot a conversation and continue it later.
#pragma once
#include <cstdint>
#include <vector>

#include "kv/kv_cache.h"

namespace flashmoe {

struct ModelState {
  int64_t pos = 0;                          // tokens consumed so far
  std::vector<KvCache> kv;                  // one per full-attention layer
  std::vector<std::vector<float>> conv;     // per linear layer: [conv_dim][K-1] previous inputs
  std::vector<std::vector<float>> ssm;      // per linear layer: [nv][dk][dv]

  size_t kv_bytes() const {
    size_t n = 0;
    for (const auto& c : kv) n += c.bytes();
    return n;
  }
  size_t recurrent_bytes() const {
    size_t n = 0;
    for (const auto& c : conv) n += c.size() * sizeof(float);
    for (const auto& s : ssm) n += s.size() * sizeof(float);
    return n;
  }
};

}  // namespace flashmoe
