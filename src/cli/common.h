// Options shared by the commands that run a model.
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "experts/expert_store.h"
#include "kv/kv_config.h"
#include "runtime/backend.h"
#include "runtime/device.h"

namespace flashmoe::cli {

struct ModelOptions {
  std::string model_dir;
  int threads = 0;  // 0: all cores
  // --device, FLASHMOE_DEVICE, --gpu-expert-cache / --gpu-host-cache, and
  // what the command sets in device.cpu_only before finalize_model_options
  // (e.g. "--hidden": something only the CPU backend implements).
  DeviceRequest device;
  KvConfig kv;
  ExpertOptions experts;
  std::string cache_policy = "lru";
  bool stats = false;  // --stats: print expert-store statistics to stderr
};

// Adds -m/--model, -t/--threads, --device, the KV-cache options, the
// expert-store options and --stats to a command.
void add_model_options(CLI::App* cmd, ModelOptions* opt, bool require_model = true);
// Validates what add_model_options parsed and settles the device as far as
// the options allow (runtime/device.h); call at the start of the callback,
// after setting ModelOptions::cpu_only if the command needs it.
void finalize_model_options(ModelOptions* opt);

// Prints the expert statistics to stderr when --stats was given (the expert
// store's on the CPU, the tiered expert cache's on a GPU), after `label` (nullptr: none;
// the statistics line begins "experts:" itself).
void print_expert_stats(const ModelOptions& opt, const Backend& backend, const char* label);

// The model of opt.model_dir loaded on the host, and the backend that runs
// it: the CPU, or the GPU for cuda and for auto when the GPU can take it
// (runtime/device.h). An explicit cuda that cannot run throws Error naming
// what failed, with a hint to use --device cpu; auto falls back to the CPU
// with one note line on stderr.
std::unique_ptr<Backend> load_model(const ModelOptions& opt);

// Parses "1,2,3" into token ids; throws Error naming the bad item.
std::vector<int32_t> parse_ids(const std::string& s);
// Comma-separated integers given to `flag` (errors name the flag).
std::vector<int32_t> parse_int_list(const std::string& flag, const std::string& s);

}  // namespace flashmoe::cli
