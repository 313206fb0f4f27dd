// What the per-conversation state of a hybrid model costs: the KV cache of
// the full-attention layers (depends on the KvConfig and the context) and the
// constant GatedDeltaNet state of the linear layers. All sizes come from the
// ModelConfig (a real config.json or a preset), never from constants.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format/config.h"
#include "kv/kv_config.h"

namespace flashmoe {

struct KvMemory {
  int64_t full_layers = 0, linear_layers = 0;
  // Per retained position, over all full-attention layers, K and V together:
  int64_t data_bytes_per_position = 0;   // layers x 2 x kv_heads x head_dim x element size
  // fp8: layers x 2 x 4 B (x kv_heads for `head` / `rotated` scales);
  // `channel`: layers x kv_heads x (3 B f24 K scale + 2 B bf16 V scale).
  int64_t scale_bytes_per_position = 0;
  int64_t bytes_per_position() const { return data_bytes_per_position + scale_bytes_per_position; }
  // fp8 `channel`: the per-channel key offsets, layers x kv_heads x head_dim
  // x 4 B per page of kFp8OffsetPage positions (a started page counts whole).
  int64_t offset_bytes_per_page = 0;
  // fp8 `channel`, once per sequence whatever its length (as soon as it
  // holds a position): the queries' second moment, layers x kv_heads x
  // head_dim (head_dim + 1) / 2 x 4 B (a packed f32 triangle), and the
  // running sum of the current page's keys that becomes the next page's
  // offsets, layers x kv_heads x head_dim x 4 B.
  int64_t query_moment_bytes = 0;
  int64_t page_sum_bytes = 0;
  int64_t sequence_bytes() const { return query_moment_bytes + page_sum_bytes; }
  // K/V bytes of `positions` retained positions: offsets and the
  // per-sequence bytes included (0 positions: 0).
  int64_t cache_bytes(int64_t positions) const;
  // Constant per conversation:
  int64_t gdn_state_bytes = 0;  // linear layers x nv x dk x dv x 4 B
  int64_t conv_state_bytes = 0; // linear layers x conv_dim x (K - 1) x 4 B
  int64_t constant_bytes() const { return gdn_state_bytes + conv_state_bytes; }
};

KvMemory kv_memory(const ModelConfig& m, const KvConfig& cfg);
// KV bytes after `context` tokens: cache_bytes(min(context, W or B)).
int64_t kv_cache_bytes(const ModelConfig& m, const KvConfig& cfg, int64_t context);

// "512 B", "40.00 KiB", "60.00 MiB", "1.25 GiB".
std::string format_bytes(int64_t bytes);
// Parses "4096,32768,128k,1M" (k = 1024, M = 1024^2); throws Error on junk.
std::vector<int64_t> parse_context_list(const std::string& s);

// The report printed by `flashmoe kv-calc`.
std::string kv_calc_report(const ModelConfig& m, const std::string& model_name, const KvConfig& cfg,
                           const std::vector<int64_t>& contexts);

}  // namespace flashmoe
