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
  // A drafting state (QwenModel::new_state with drafting) also keeps the
  // MTP head's layer up to date, so it can draft at any point: its KV cache
  // holds one entry per consumed token but the last (entry j combines the
  // main model's hidden state at j with token j+1, at RoPE position j), and
  // mtp_hidden is the final-normed hidden state of the last consumed token
  // (empty before the first).
  bool drafting = false;
  std::vector<KvCache> mtp_kv;  // one when drafting
  std::vector<float> mtp_hidden;

  size_t kv_bytes() const {
    size_t n = 0;
    for (const auto& c : kv) n += c.bytes();
    for (const auto& c : mtp_kv) n += c.bytes();
    return n;
  }
  size_t recurrent_bytes() const {
    size_t n = 0;
    for (const auto& c : conv) n += c.size() * sizeof(float);
    for (const auto& s : ssm) n += s.size() * sizeof(float);
    return n + mtp_hidden.size() * sizeof(float);
  }
};

}  // namespace flashmoe
