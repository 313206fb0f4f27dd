// Where the MoE block gets routed experts' weights from. The forward pass asks
// for the experts one layer's router picked; the store hands back views that
// stay valid while the returned batch lives. Implementations: in memory
// (views into the mmapped checkpoint or packed files) and streaming (pread
// from packed per-layer files into a bounded cache).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "experts/ffn_expert.h"

namespace flashmoe {

enum class CachePolicy { Lru, Lfu };

// Chosen on the command line (cli/common.cpp), passed to QwenModel::load.
struct ExpertOptions {
  std::string store = "auto";  // auto (stream when packed), mmap, stream
  int64_t cache_mb = -1;       // streaming cache; -1: as large as --max-memory (else 3/4 of RAM) allows, at most all experts
  CachePolicy policy = CachePolicy::Lru;
  int io_threads = 4;
  bool direct_io = false;      // O_DIRECT reads (cold-cache measurements); falls back when unsupported
  double max_memory_gb = 0;    // whole-process budget; 0: none
  int64_t experts_per_token = 0;  // --moe-top-k: fewer routed experts per token (limit_experts_per_token); 0: the model's own
};

struct ExpertStats {
  uint64_t tokens = 0;             // tokens the model has processed
  uint64_t requested = 0;          // experts asked for (one per layer per distinct expert per fetch)
  uint64_t hits = 0, misses = 0;   // served from the own cache / read from disk
  uint64_t bytes_read = 0;
  double io_wait_s = 0;            // time the forward pass spent waiting for reads
  // Wall time reads were in flight: per fetch, from submitting its misses to
  // the last one landing (checksum included); bytes_read / read_s is the
  // rate the store streams at, to set beside the disk's own.
  double read_s = 0;
  uint64_t cache_bytes = 0, cache_capacity = 0;
  uint64_t expert_bytes = 0;       // one expert's record
};

// A fetched set of experts; `pins` keep streamed buffers alive while in use.
struct ExpertBatch {
  std::vector<FfnExpert> experts;  // parallel to the ids asked for
  std::vector<std::shared_ptr<const void>> pins;
};

class ExpertStore {
 public:
  virtual ~ExpertStore() = default;
  // Views of the given experts of MoE layer `layer`. Throws Error (naming the
  // file and expert) if one cannot be read or fails its checksum.
  // `while_waiting` (if given) runs once on the calling thread while a
  // streaming store's reads of this fetch are in flight, and not at all
  // when nothing is read (every expert in memory or cached): the MoE block
  // computes the shared expert there, hiding part of the I/O behind
  // compute, and otherwise beside the routed experts.
  virtual ExpertBatch fetch(int64_t layer, const std::vector<int32_t>& ids,
                            const std::function<void()>& while_waiting = nullptr) = 0;
  virtual ExpertStats stats() const = 0;
  virtual void reset_stats() = 0;
  virtual void note_tokens(int64_t n) = 0;
  virtual std::string describe() const = 0;
};

// Parses "lru" / "lfu"; throws Error otherwise.
CachePolicy parse_cache_policy(const std::string& s);
const char* cache_policy_name(CachePolicy p);
// One human-readable block of statistics (for --stats).
std::string format_expert_stats(const ExpertStats& s, int64_t layers_moe, int64_t top_k);

}  // namespace flashmoe
