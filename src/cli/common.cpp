#include "cli/common.h"

#include <cerrno>
#include <cstdlib>

#include "cli/kv_options.h"
#include "core/error.h"
#include "model/qwen_model.h"
#include <cstdio>

namespace flashmoe::cli {

void add_model_options(CLI::App* cmd, ModelOptions* opt) {
  cmd->add_option("-m,--model", opt->model_dir, "Model directory (config.json + safetensors)")->required();
  cmd->add_option("-t,--threads", opt->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  add_kv_options(cmd, &opt->kv);
  cmd->add_option("--expert-store", opt->experts.store,
                  "Where routed experts come from: auto (stream a packed model, memory otherwise), mmap, stream");
  cmd->add_option("--expert-cache", opt->experts.cache_mb,
                  "Streaming expert cache in MiB (0: none, read through the OS page cache; default: as much as "
                  "--max-memory allows, else up to 3/4 of RAM; at most all experts)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--expert-cache-policy", opt->cache_policy, "Cache eviction: lru (default) or lfu (frequency-aware)");
  cmd->add_option("--io-threads", opt->experts.io_threads, "Threads reading experts from disk (default 4)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--direct-io", opt->experts.direct_io,
                "Read experts with O_DIRECT (bypass the page cache; for cold-cache measurements)");
  cmd->add_option("--max-memory", opt->experts.max_memory_gb,
                  "Memory budget of the whole process in GiB; caches are sized to stay under it")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--stats", opt->stats, "Print expert-store statistics (hit rate, bytes and reads per token, I/O wait)");
}

void finalize_model_options(ModelOptions* opt) {
  finalize_kv_options(&opt->kv);
  opt->experts.policy = parse_cache_policy(opt->cache_policy);
}

void print_expert_stats(const ModelOptions& opt, const QwenModel& model, const char* label) {
  if (!opt.stats) return;
  const ModelConfig& c = model.config();
  int64_t moe = 0;
  for (bool b : c.layer_is_moe) moe += b ? 1 : 0;
  std::fprintf(stderr, "%s %s\n  store: %s\n", label,
               format_expert_stats(model.expert_store().stats(), moe, c.num_experts_per_tok).c_str(),
               model.expert_store().describe().c_str());
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    char* end = nullptr;
    errno = 0;
    long long v = item.empty() ? 0 : std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno == ERANGE || v < INT32_MIN || v > INT32_MAX)
      fail("--ids: '" + item + "' is not a token id (expected comma-separated integers like 1,2,3)");
    ids.push_back(int32_t(v));
    i = j + 1;
  }
  if (ids.empty()) fail("--ids: no token ids given");
  return ids;
}

}  // namespace flashmoe::cli
