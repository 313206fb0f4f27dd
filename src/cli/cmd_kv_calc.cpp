// flashmoe kv-calc: what a conversation costs in KV cache and GatedDeltaNet
// state, for a model's config.json (or a published-model preset).
#include <cstdio>

#include "cli/command.h"
#include "cli/kv_options.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "format/config.h"
#include "format/gguf.h"
#include "format/gguf_config.h"
#include "format/model_files.h"
#include "kv/memory_calc.h"
#include "kv/presets.h"

namespace flashmoe::cli {

namespace {

struct KvCalcArgs {
  std::string model, preset, contexts = "4096,32768,131072";
  KvConfig kv;
};

void run_kv_calc(const KvCalcArgs& a) {
  KvConfig kv = a.kv;
  finalize_kv_options(&kv);
  if (a.model.empty() == a.preset.empty()) {
    std::string names;
    for (const auto& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail("kv-calc needs exactly one of -m DIR_OR_CONFIG_JSON or --preset NAME (" + names + ")");
  }
  // A directory is resolved as every other command does it (a model
  // directory, or a bundle holding it as model/); a file is a config.json.
  const std::string config = a.model.empty() || !is_directory(a.model) ? a.model : resolve_model_files(a.model).model_dir;
  const ModelConfig m = !a.preset.empty()            ? model_preset(a.preset)
                        : is_gguf_path(a.model)      ? gguf_model_config(GgufModel(a.model))
                                                     : load_model_config(config);
  if (m.num_full_layers() > 0 && (m.num_kv_heads <= 0 || m.head_dim <= 0))
    fail("config has full-attention layers but no KV heads / head_dim");
  const std::string name = a.preset.empty() ? a.model : a.preset + " (preset)";
  std::fputs(kv_calc_report(m, name, kv, parse_context_list(a.contexts)).c_str(), stdout);
}

const Registrar reg_kv_calc(80, [](CLI::App& app) {
  auto args = std::make_shared<KvCalcArgs>();
  CLI::App* cmd = app.add_subcommand("kv-calc", "KV cache and GatedDeltaNet state memory per conversation");
  cmd->add_option("-m,--model", args->model, "model directory, config.json or .gguf file");
  cmd->add_option("--preset", args->preset,
                  "published model instead of a config: qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, "
                  "qwen3-next-80b-a3b");
  cmd->add_option("--context", args->contexts, "comma-separated context lengths (k = 1024)")->capture_default_str();
  add_kv_options(cmd, &args->kv);
  cmd->callback([args] { run_kv_calc(*args); });
});

}  // namespace

}  // namespace flashmoe::cli
