#include "experts/expert_store.h"

#include <cstdio>

#include "core/error.h"

namespace flashmoe {

CachePolicy parse_cache_policy(const std::string& s) {
  if (s == "lru") return CachePolicy::Lru;
  if (s == "lfu") return CachePolicy::Lfu;
  fail("--expert-cache-policy: unknown policy '" + s + "' (expected lru or lfu)");
}

const char* cache_policy_name(CachePolicy p) { return p == CachePolicy::Lru ? "lru" : "lfu"; }

std::string format_expert_stats(const ExpertStats& s, int64_t layers_moe, int64_t top_k) {
  char buf[1024];
  const double tok = s.tokens ? double(s.tokens) : 1.0;
  const double hit = s.requested ? 100.0 * double(s.hits) / double(s.requested) : 0.0;
  const double ideal = double(top_k * layers_moe) * double(s.expert_bytes);
  std::snprintf(buf, sizeof buf,
                "experts: %llu tokens, %llu fetched, hit rate %.1f%%, %llu reads (%.1f per token), "
                "%.2f MiB read (%.3f MiB per token; ideal top-k x expert x layers = %.3f MiB), "
                "I/O wait %.3f s, reads in flight %.3f s (%.1f MiB/s), cache %.1f / %.1f MiB",
                (unsigned long long)s.tokens, (unsigned long long)s.requested, hit, (unsigned long long)s.misses,
                double(s.misses) / tok, double(s.bytes_read) / 1048576.0, double(s.bytes_read) / tok / 1048576.0,
                ideal / 1048576.0, s.io_wait_s, s.read_s,
                s.read_s > 0 ? double(s.bytes_read) / 1048576.0 / s.read_s : 0.0, double(s.cache_bytes) / 1048576.0, double(s.cache_capacity) / 1048576.0);
  return buf;
}

}  // namespace flashmoe
