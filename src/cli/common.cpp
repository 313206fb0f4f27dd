#include "cli/common.h"

#include <cerrno>
#include <cstdlib>

#include "cli/kv_options.h"
#include "cli/validators.h"
#include "core/error.h"
#include "model/qwen_model.h"
#include <cstdio>

namespace flashmoe::cli {

void add_model_options(CLI::App* cmd, ModelOptions* opt, bool require_model) {
  auto* m = cmd->add_option("-m,--model", opt->model_dir, "Model directory (config.json + safetensors) or .gguf file (the first part of a split one)");
  if (require_model) m->required();
  cmd->add_option("-t,--threads", opt->threads, "Threads (default: all cores)")->check(integer_between(0, 2147483647));
  cmd->add_option("--device", opt->device.device,
                  "Where the forward pass runs: auto (default: GPU 0 when it is usable and can run this, else the "
                  "CPU), cpu, or cuda (GPU 0; an error when it cannot); the environment variable FLASHMOE_DEVICE "
                  "sets the default")
      ->type_name("cpu|cuda|auto")
      ->each([opt](const std::string&) { opt->device.source = "--device"; });
  add_kv_options(cmd, &opt->kv);
  cmd->add_option("--expert-store", opt->experts.store,
                  "Where routed experts come from: auto (stream a packed model, memory otherwise), mmap, stream");
  cmd->add_option("--expert-cache", opt->experts.cache_mb,
                  "Streaming expert cache in MiB (0: none, read through the OS page cache; default: as much as "
                  "--max-memory allows, else up to 3/4 of RAM; at most all experts)")->check(integer_at_least(0));
  cmd->add_option("--expert-cache-policy", opt->cache_policy, "Cache eviction: lru (default) or lfu (frequency-aware)");
  cmd->add_option("--io-threads", opt->experts.io_threads, "Threads reading experts from disk (default 4)")
      ->check(integer_between(1, 2147483647));
  cmd->add_flag("--direct-io", opt->experts.direct_io,
                "Read experts with O_DIRECT (bypass the page cache; for cold-cache measurements)");
  cmd->add_option("--max-memory", opt->experts.max_memory_gb,
                  "Memory budget of the whole process in GiB; caches are sized to stay under it")
      ->check(greater_than(0));
  cmd->add_option("--gpu-expert-cache", opt->device.gpu_expert_cache,
                  "On the GPU (--device cuda or auto): VRAM for routed experts, in GB (e.g. 20), as a share of all expert "
                  "bytes (e.g. 50%) or auto (as many as fit beside the other weights, less a 4 GiB margin); the rest "
                  "stay in pinned host memory, read over the host link and promoted to VRAM when hot (default: auto, "
                  "which is every expert in VRAM when they fit; --stats prints the plan)")
      ->type_name("GB|N%|auto");
  cmd->add_option("--gpu-host-cache", opt->device.gpu_host_cache,
                  "With --gpu-expert-cache: pinned host memory for the experts outside VRAM, in GB or as a share of "
                  "all expert bytes (default: all of them, up to the available host memory less a margin of 8 GiB "
                  "or 10%); the others are read from the model's files when chosen "
                  "(each step waits for them; prompts go in chunks of host slots / top-k tokens)")
      ->type_name("GB|N%");
  cmd->add_option_function<std::string>(
         "--gguf-experts", [opt](const std::string& v) { opt->device.gpu.gguf_expert_chunks = v == "chunks"; },
         "On the GPU, a GGUF model's routed Q4_K / Q6_K experts in VRAM: chunks (default: rearranged at load for "
         "the decode kernels, 33% / 22% more bytes, where VRAM allows; docs/gguf.md) or stored (as the file stores "
         "them)")
      ->check(CLI::IsMember({"chunks", "stored"}));
  cmd->add_option("--gpus", opt->device.gpus,
                  "Run on GPUs 0..N-1 at once (expert parallel over NCCL: each GPU holds the whole model but a "
                  "share of the routed experts, one all-reduce per MoE layer; docs/multi-gpu.md). 1 runs the same "
                  "path on one GPU. Needs a build with NCCL")
      ->type_name("N")
      ->check(integer_between(1, 64));
  cmd->add_option("--devices", opt->device.gpu_list,
                  "As --gpus, on the GPUs listed (comma-separated CUDA device numbers, e.g. 0,1)")
      ->type_name("LIST");
  cmd->add_option("--moe-top-k", opt->experts.experts_per_token,
                  "Route each token to its K most probable experts instead of the model's num_experts_per_tok "
                  "(1 <= K <= that value; the kept router weights are renormalised as the model renormalises its own "
                  "top-k). Faster and reads fewer expert bytes, at a quality cost: docs/huge-models-ssd.md")
      ->type_name("K")
      ->check(integer_at_least(1));
  cmd->add_flag("--stats", opt->stats, "Print expert-store statistics (hit rate, bytes and reads per token, I/O wait, the rate reads stream at)");
}

void finalize_model_options(ModelOptions* opt) {
  finalize_kv_options(&opt->kv);
  // The CUDA attention kernels read keys without offsets.
  if (opt->kv.dtype == KvDType::FP8 && opt->kv.fp8_scale == Fp8ScaleMode::Channel && opt->device.cpu_only.empty())
    opt->device.cpu_only = "--kv-fp8-scale channel";
  // "GB" or "N%" into gb or fraction.
  auto size = [](const std::string& flag, const std::string& v, double* gb, double* fraction) {
    const bool pct = v.back() == '%';
    char* end = nullptr;
    errno = 0;
    const std::string num = pct ? v.substr(0, v.size() - 1) : v;
    const double d = std::strtod(num.c_str(), &end);
    if (num.empty() || *end != '\0' || errno == ERANGE || !(d >= 0) || (pct && d > 100))
      fail(flag + ": '" + v + "' is not a size (expected GB like 20 or 0.5, or a share like 50%)");
    if (pct) *fraction = d / 100.0;
    else *gb = d;
  };
  DeviceRequest& d = opt->device;
  // auto: as many experts in VRAM as fit (the memory plan), as when the flag is not given.
  if (!d.gpu_expert_cache.empty() && d.gpu_expert_cache != "auto")
    size("--gpu-expert-cache", d.gpu_expert_cache, &d.gpu.expert_cache_gb, &d.gpu.expert_cache_fraction);
  d.gpu.show_plan = opt->stats;
  if (!d.gpu_host_cache.empty()) {
    size("--gpu-host-cache", d.gpu_host_cache, &d.gpu.host_cache_gb, &d.gpu.host_cache_fraction);
    if (d.gpu_expert_cache.empty())
      fail("--gpu-host-cache needs --gpu-expert-cache (without it every expert is in VRAM)");
  }
  if (d.gpus > 0 && !d.gpu_list.empty()) fail("--gpus and --devices: give one of them");
  if (d.gpus > 0)
    for (int g = 0; g < d.gpus; ++g) d.gpu.devices.push_back(g);
  if (!d.gpu_list.empty()) {
    for (int32_t g : parse_int_list("--devices", d.gpu_list)) {
      if (g < 0) fail("--devices: " + std::to_string(g) + " is not a GPU number (expected 0 or more)");
      d.gpu.devices.push_back(g);
    }
  }
  settle_device(&d);
  opt->experts.policy = parse_cache_policy(opt->cache_policy);
}

void print_expert_stats(const ModelOptions& opt, const Backend& backend, const char* label) {
  if (!opt.stats) return;
  if (label) std::fprintf(stderr, "%s %s\n", label, backend.expert_stats().c_str());
  else std::fprintf(stderr, "%s\n", backend.expert_stats().c_str());
}

std::unique_ptr<Backend> load_model(const ModelOptions& opt) {
  std::shared_ptr<const QwenModel> host = QwenModel::load(opt.model_dir, opt.experts);
  return open_backend(opt.device, std::move(host));
}

std::vector<int32_t> parse_ids(const std::string& s) { return parse_int_list("--ids", s); }

std::vector<int32_t> parse_int_list(const std::string& flag, const std::string& s) {
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
      fail(flag + ": '" + item + "' is not " + (flag == "--ids" ? "a token id" : "a number") +
           " (expected comma-separated integers like 1,2,3)");
    ids.push_back(int32_t(v));
    i = j + 1;
  }
  if (ids.empty()) fail(flag + (flag == "--ids" ? ": no token ids given" : ": nothing given"));
  return ids;
}

}  // namespace flashmoe::cli
