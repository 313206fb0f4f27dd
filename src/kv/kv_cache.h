// The key/value cache of one full-attention layer, and the attention of one
// query token over it. Storage format and retention policy come from KvConfig.
#pragma once
#include <cstdint>
#include <vector>

#include "kv/kv_config.h"

namespace flashmoe {

class KvCache {
 public:
  KvCache(int64_t num_kv_heads, int64_t head_dim, const KvConfig& cfg);

  // Stores K and V ([num_kv_heads * head_dim] each, K already normed and
  // rotated) of the token at absolute position `pos`.
  void append(int64_t pos, const float* k, const float* v);

  // Softmax attention of one query token (q: [num_heads * head_dim], GQA:
  // head h reads kv head h / (num_heads / num_kv_heads)) over every retained
  // position; writes out [num_heads * head_dim].
  void attend(const float* q, int64_t num_heads, float scale, float* out);

  int64_t size() const { return int64_t(pos_.size()); }  // positions retained
  size_t bytes() const;                                  // storage allocated
  const KvConfig& config() const { return cfg_; }
  void clear();

 private:
  int64_t nkv_, hd_;
  KvConfig cfg_;
  std::vector<float> k_, v_;     // [slot][kv_head][head_dim]
  std::vector<int64_t> pos_;     // absolute position per slot
  std::vector<float> scores_;    // scratch
};

}  // namespace flashmoe
