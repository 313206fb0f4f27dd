#include "server/metrics.h"

#include <cstdio>

namespace flashmoe::server {

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::count_generation(int64_t prompt_tokens, int64_t reused_tokens, int64_t generated_tokens,
                               double prompt_seconds, double gen_seconds, bool cancelled) {
  prompt_ += prompt_tokens;
  reused_ += reused_tokens;
  generated_ += generated_tokens;
  ++generations_;
  if (cancelled) ++cancelled_;
  std::lock_guard<std::mutex> lock(mu_);
  prompt_seconds_ += prompt_seconds;
  gen_seconds_ += gen_seconds;
}

void Metrics::count_speculation(int64_t passes, int64_t drafted, int64_t accepted) {
  spec_passes_ += passes;
  spec_drafted_ += drafted;
  spec_accepted_ += accepted;
}

namespace {
void line(std::string& out, const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  out += buf;
}
void help(std::string& out, const char* name, const char* type, const char* text) {
  line(out, "# HELP %s %s\n# TYPE %s %s\n", name, text, name, type);
}
}  // namespace

std::string Metrics::render(const Gauges& g) const {
  std::string o;
  std::lock_guard<std::mutex> lock(mu_);
  help(o, "flashmoe_requests_total", "counter", "HTTP requests by endpoint and status code.");
  for (const auto& [k, n] : requests_)
    line(o, "flashmoe_requests_total{endpoint=\"%s\",status=\"%d\"} %lld\n", k.first.c_str(), k.second, (long long)n);
  help(o, "flashmoe_generations_total", "counter", "Completions run (streamed or not).");
  line(o, "flashmoe_generations_total %lld\n", (long long)generations_.load());
  help(o, "flashmoe_generations_cancelled_total", "counter", "Completions cancelled (client disconnected or shutdown).");
  line(o, "flashmoe_generations_cancelled_total %lld\n", (long long)cancelled_.load());
  help(o, "flashmoe_prompt_tokens_total", "counter", "Prompt tokens of all completions.");
  line(o, "flashmoe_prompt_tokens_total %lld\n", (long long)prompt_.load());
  help(o, "flashmoe_prompt_tokens_reused_total", "counter", "Prompt tokens served from a stored conversation state.");
  line(o, "flashmoe_prompt_tokens_reused_total %lld\n", (long long)reused_.load());
  help(o, "flashmoe_prompt_tokens_recomputed_total", "counter", "Prompt tokens run through the model.");
  line(o, "flashmoe_prompt_tokens_recomputed_total %lld\n", (long long)(prompt_.load() - reused_.load()));
  help(o, "flashmoe_generated_tokens_total", "counter", "Tokens generated.");
  line(o, "flashmoe_generated_tokens_total %lld\n", (long long)generated_.load());
  help(o, "flashmoe_spec_passes_total", "counter", "Verify passes of speculative decoding (--mtp).");
  line(o, "flashmoe_spec_passes_total %lld\n", (long long)spec_passes_.load());
  help(o, "flashmoe_spec_drafted_tokens_total", "counter", "Tokens the MTP head drafted (--mtp).");
  line(o, "flashmoe_spec_drafted_tokens_total %lld\n", (long long)spec_drafted_.load());
  help(o, "flashmoe_spec_accepted_tokens_total", "counter", "Drafted tokens the model accepted (--mtp).");
  line(o, "flashmoe_spec_accepted_tokens_total %lld\n", (long long)spec_accepted_.load());
  help(o, "flashmoe_prompt_seconds_total", "counter", "Time spent on prompt processing.");
  line(o, "flashmoe_prompt_seconds_total %.6f\n", prompt_seconds_);
  help(o, "flashmoe_generation_seconds_total", "counter", "Time spent generating.");
  line(o, "flashmoe_generation_seconds_total %.6f\n", gen_seconds_);
  help(o, "flashmoe_prompt_tokens_per_second", "gauge", "Recomputed prompt tokens per second of prompt time, over all requests.");
  line(o, "flashmoe_prompt_tokens_per_second %.3f\n",
       prompt_seconds_ > 0 ? double(prompt_.load() - reused_.load()) / prompt_seconds_ : 0.0);
  help(o, "flashmoe_generation_tokens_per_second", "gauge", "Generated tokens per second of generation time, over all requests.");
  line(o, "flashmoe_generation_tokens_per_second %.3f\n", gen_seconds_ > 0 ? double(generated_.load()) / gen_seconds_ : 0.0);
  help(o, "flashmoe_kv_cache_bytes", "gauge", "KV cache bytes held by the requests running now.");
  line(o, "flashmoe_kv_cache_bytes %lld\n", (long long)g.kv_bytes_active);
  help(o, "flashmoe_recurrent_state_bytes", "gauge", "Linear-attention state bytes held by the requests running now.");
  line(o, "flashmoe_recurrent_state_bytes %lld\n", (long long)g.state_bytes_active);
  help(o, "flashmoe_state_cache_bytes", "gauge", "Bytes held by stored conversation snapshots (KV + recurrent state; host memory or VRAM).");
  line(o, "flashmoe_state_cache_bytes %lld\n", (long long)g.snapshot_bytes);
  help(o, "flashmoe_state_cache_entries", "gauge", "Stored conversation snapshots.");
  line(o, "flashmoe_state_cache_entries %lld\n", (long long)g.snapshots);
  help(o, "flashmoe_slots_busy", "gauge", "Model slots running a request.");
  line(o, "flashmoe_slots_busy %lld\n", (long long)g.slots_busy);
  help(o, "flashmoe_slots_total", "gauge", "Model slots (--parallel).");
  line(o, "flashmoe_slots_total %lld\n", (long long)g.slots_total);
  help(o, "flashmoe_queue_waiting", "gauge", "Requests waiting for a slot.");
  line(o, "flashmoe_queue_waiting %lld\n", (long long)g.queue_waiting);
  help(o, "flashmoe_batch_sequences_active", "gauge", "Requests attached to the batch scheduler now (each step may run all of them).");
  line(o, "flashmoe_batch_sequences_active %lld\n", (long long)g.batch_attached);
  help(o, "flashmoe_batch_last_step_sequences", "gauge", "Sequences in the latest step (the batch size).");
  line(o, "flashmoe_batch_last_step_sequences %lld\n", (long long)g.batch_last_sequences);
  help(o, "flashmoe_batch_last_step_tokens", "gauge", "Tokens in the latest step (decode tokens plus prompt chunks).");
  line(o, "flashmoe_batch_last_step_tokens %lld\n", (long long)g.batch_last_tokens);
  help(o, "flashmoe_batch_steps_total", "counter", "Batched forward steps run.");
  line(o, "flashmoe_batch_steps_total %lld\n", (long long)g.batch_steps);
  help(o, "flashmoe_batch_step_sequences_total", "counter",
       "Sequences summed over all steps (/ steps: the mean batch size).");
  line(o, "flashmoe_batch_step_sequences_total %lld\n", (long long)g.batch_step_sequences);
  help(o, "flashmoe_batch_step_tokens_total", "counter", "Tokens summed over all steps (/ steps: mean tokens per step).");
  line(o, "flashmoe_batch_step_tokens_total %lld\n", (long long)g.batch_step_tokens);
  help(o, "flashmoe_expert_cache_hit_ratio", "gauge",
       "Routed experts served without a disk read / experts requested (1 when all experts are in memory; 0 before any).");
  line(o, "flashmoe_expert_cache_hit_ratio %.6f\n",
       g.expert_requested ? double(g.expert_hits) / double(g.expert_requested) : 0.0);
  help(o, "flashmoe_expert_cache_misses_total", "counter", "Routed experts read from disk.");
  line(o, "flashmoe_expert_cache_misses_total %llu\n", (unsigned long long)g.expert_misses);
  help(o, "flashmoe_expert_bytes_read_total", "counter", "Bytes of expert weights read from disk.");
  line(o, "flashmoe_expert_bytes_read_total %llu\n", (unsigned long long)g.expert_bytes_read);
  return o;
}

}  // namespace flashmoe::server
