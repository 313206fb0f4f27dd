// Counters for GET /metrics, rendered in the Prometheus text format.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace flashmoe::server {

class Metrics {
 public:
  void count_request(const std::string& endpoint, int status);
  // One finished generation (whatever its outcome).
  void count_generation(int64_t prompt_tokens, int64_t reused_tokens, int64_t generated_tokens,
                        double prompt_seconds, double gen_seconds, bool cancelled);
  // Speculative decoding (--mtp) of one generation: verify passes, drafted
  // and accepted tokens.
  void count_speculation(int64_t passes, int64_t drafted, int64_t accepted);

  struct Gauges {
    int64_t kv_bytes_active = 0;     // KV caches of the requests running now
    int64_t state_bytes_active = 0;  // their recurrent (linear-attention) states
    int64_t snapshot_bytes = 0;      // the state cache
    int64_t snapshots = 0;
    int64_t slots_busy = 0, slots_total = 0, queue_waiting = 0;
    // The batch scheduler: sequences attached now, the latest step's
    // sequences and tokens, and the totals over all steps.
    int64_t batch_attached = 0, batch_last_sequences = 0, batch_last_tokens = 0;
    int64_t batch_steps = 0, batch_step_sequences = 0, batch_step_tokens = 0;
    uint64_t expert_requested = 0, expert_hits = 0, expert_misses = 0, expert_bytes_read = 0;
  };
  std::string render(const Gauges& g) const;

  int64_t reused_tokens() const { return reused_.load(); }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
  double prompt_seconds_ = 0, gen_seconds_ = 0;
  std::atomic<int64_t> prompt_{0}, reused_{0}, generated_{0}, cancelled_{0}, generations_{0};
  std::atomic<int64_t> spec_passes_{0}, spec_drafted_{0}, spec_accepted_{0};
};

}  // namespace flashmoe::server
