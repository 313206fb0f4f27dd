// Options shared by the commands that run a model.
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "experts/expert_store.h"
#include "kv/kv_config.h"

namespace flashmoe {
class QwenModel;
}

namespace flashmoe::cli {

struct ModelOptions {
  std::string model_dir;
  int threads = 0;  // 0: all cores
  KvConfig kv;
  ExpertOptions experts;
  std::string cache_policy = "lru";
  bool stats = false;  // --stats: print expert-store statistics to stderr
};

// Adds -m/--model, -t/--threads, the expert-store options and --stats to a command.
void add_model_options(CLI::App* cmd, ModelOptions* opt);
// Validates what add_model_options parsed; call at the start of the callback.
void finalize_model_options(ModelOptions* opt);

// Prints the expert-store statistics to stderr when --stats was given.
void print_expert_stats(const ModelOptions& opt, const QwenModel& model, const char* label);

// Parses "1,2,3" into token ids; throws Error naming the bad item.
std::vector<int32_t> parse_ids(const std::string& s);

}  // namespace flashmoe::cli
