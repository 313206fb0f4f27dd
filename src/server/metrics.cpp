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
// A metric without labels: its HELP and TYPE lines, then its one sample,
// an integer or a real with `digits` decimals.
void metric(std::string& out, const char* name, const char* type, const char* text, long long v) {
  help(out, name, type, text);
  line(out, "%s %lld\n", name, v);
}
void metric(std::string& out, const char* name, const char* type, const char* text, double v, int digits) {
  help(out, name, type, text);
  line(out, "%s %.*f\n", name, digits, v);
}
}  // namespace

std::string Metrics::render(const Gauges& g) const {
  std::string o;
  std::lock_guard<std::mutex> lock(mu_);
  help(o, "flashmoe_requests_total", "counter", "HTTP requests by endpoint and status code.");
  for (const auto& [k, n] : requests_)
    line(o, "flashmoe_requests_total{endpoint=\"%s\",status=\"%d\"} %lld\n", k.first.c_str(), k.second, (long long)n);
  const long long prompt = prompt_.load(), reused = reused_.load(), generated = generated_.load();
  metric(o, "flashmoe_generations_total", "counter", "Completions run (streamed or not).", generations_.load());
  metric(o, "flashmoe_generations_cancelled_total", "counter", "Completions cancelled (client disconnected or shutdown).",
         cancelled_.load());
  metric(o, "flashmoe_prompt_tokens_total", "counter", "Prompt tokens of all completions.", prompt);
  metric(o, "flashmoe_prompt_tokens_reused_total", "counter", "Prompt tokens served from a stored conversation state.",
         reused);
  metric(o, "flashmoe_prompt_tokens_recomputed_total", "counter", "Prompt tokens run through the model.",
         prompt - reused);
  metric(o, "flashmoe_generated_tokens_total", "counter", "Tokens generated.", generated);
  metric(o, "flashmoe_spec_passes_total", "counter", "Verify passes of speculative decoding (--mtp).",
         spec_passes_.load());
  metric(o, "flashmoe_spec_drafted_tokens_total", "counter", "Tokens the MTP head drafted (--mtp).",
         spec_drafted_.load());
  metric(o, "flashmoe_spec_accepted_tokens_total", "counter", "Drafted tokens the model accepted (--mtp).",
         spec_accepted_.load());
  metric(o, "flashmoe_prompt_seconds_total", "counter", "Time spent on prompt processing.", prompt_seconds_, 6);
  metric(o, "flashmoe_generation_seconds_total", "counter", "Time spent generating.", gen_seconds_, 6);
  metric(o, "flashmoe_prompt_tokens_per_second", "gauge",
         "Recomputed prompt tokens per second of prompt time, over all requests.",
         prompt_seconds_ > 0 ? double(prompt - reused) / prompt_seconds_ : 0.0, 3);
  metric(o, "flashmoe_generation_tokens_per_second", "gauge",
         "Generated tokens per second of generation time, over all requests.",
         gen_seconds_ > 0 ? double(generated) / gen_seconds_ : 0.0, 3);
  metric(o, "flashmoe_kv_cache_bytes", "gauge", "KV cache bytes held by the requests running now.", g.kv_bytes_active);
  metric(o, "flashmoe_recurrent_state_bytes", "gauge", "Linear-attention state bytes held by the requests running now.",
         g.state_bytes_active);
  metric(o, "flashmoe_state_cache_bytes", "gauge",
         "Bytes held by stored conversation snapshots (KV + recurrent state; host memory or VRAM).", g.snapshot_bytes);
  metric(o, "flashmoe_state_cache_entries", "gauge", "Stored conversation snapshots.", g.snapshots);
  metric(o, "flashmoe_slots_busy", "gauge", "Model slots running a request.", g.slots_busy);
  metric(o, "flashmoe_slots_total", "gauge", "Model slots (--parallel).", g.slots_total);
  metric(o, "flashmoe_queue_waiting", "gauge", "Requests waiting for a slot.", g.queue_waiting);
  metric(o, "flashmoe_batch_sequences_active", "gauge",
         "Requests attached to the batch scheduler now (each step may run all of them).", g.batch_attached);
  metric(o, "flashmoe_batch_last_step_sequences", "gauge", "Sequences in the latest step (the batch size).",
         g.batch_last_sequences);
  metric(o, "flashmoe_batch_last_step_tokens", "gauge", "Tokens in the latest step (decode tokens plus prompt chunks).",
         g.batch_last_tokens);
  metric(o, "flashmoe_batch_steps_total", "counter", "Batched forward steps run.", g.batch_steps);
  metric(o, "flashmoe_batch_step_sequences_total", "counter",
         "Sequences summed over all steps (/ steps: the mean batch size).", g.batch_step_sequences);
  metric(o, "flashmoe_batch_step_tokens_total", "counter", "Tokens summed over all steps (/ steps: mean tokens per step).",
         g.batch_step_tokens);
  metric(o, "flashmoe_expert_cache_hit_ratio", "gauge",
         "Routed experts served without a disk read / experts requested (1 when all experts are in memory; 0 before any).",
         g.expert_requested ? double(g.expert_hits) / double(g.expert_requested) : 0.0, 6);
  metric(o, "flashmoe_expert_cache_misses_total", "counter", "Routed experts read from disk.",
         static_cast<long long>(g.expert_misses));
  metric(o, "flashmoe_expert_bytes_read_total", "counter", "Bytes of expert weights read from disk.",
         static_cast<long long>(g.expert_bytes_read));
  return o;
}

}  // namespace flashmoe::server
