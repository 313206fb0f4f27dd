// --synthetic and the options that shape it, shared by bench, serve and
// generate: a model with random weights (seed 1234, as bench has always
// built them) of a published size (a preset: qwen3.5-35b-a3b, ...) or of the
// shape a config.json describes, built on the device instead of loaded
// from -m.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "cli/common.h"
#include "format/config.h"
#include "runtime/backend.h"

namespace flashmoe::cli {

struct SyntheticOptions {
  std::string name;  // a preset or a config.json (or a directory holding one); empty: no --synthetic
  int layers = 0;    // only the first N layers (0: all)
  std::string experts = "bf16";
  std::string weights = "bf16";
  int group = 64;
  // Set by add_synthetic_options: whether each shaping option was given.
  CLI::Option *layers_opt = nullptr, *experts_opt = nullptr, *weights_opt = nullptr, *group_opt = nullptr;
  bool given() const { return !name.empty(); }
};

void add_synthetic_options(CLI::App* cmd, SyntheticOptions* s);

// `command` names the command in errors. Throws Error for -m together with
// --synthetic, neither of them, shaping options without --synthetic, or
// formats that do not go together.
void check_synthetic_options(const std::string& command, const SyntheticOptions& s, const ModelOptions& model);

// The config of --synthetic (a preset, else a config.json), with --layers
// and --moe-top-k applied; throws Error naming the unknown name.
ModelConfig synthetic_config(const SyntheticOptions& s, const ModelOptions& opt);

// The synthetic model on opt's device (the CPU, or the GPU). `what`
// receives a one-line description for reports.
std::unique_ptr<Backend> build_synthetic_model(const ModelOptions& opt, const SyntheticOptions& s, bool mtp_head,
                                               std::string* what);

}  // namespace flashmoe::cli
