#include "cli/synthetic_options.h"

#include <filesystem>

#include "cli/validators.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "experts/expert_layout.h"
#include "kv/presets.h"
#include "runtime/bench_support.h"

namespace flashmoe::cli {

void add_synthetic_options(CLI::App* cmd, SyntheticOptions* s) {
  const char* g = "Synthetic model";
  cmd->add_option("--synthetic", s->name,
                  "Random weights instead of -m: a published size (qwen3.5-35b-a3b, qwen3.5-122b-a10b, "
                  "qwen3.5-397b-a17b, qwen3-next-80b-a3b) or the shape a config.json describes (the file or its "
                  "directory); built on the GPU, or with --device cpu in host memory (its embedding tied to the "
                  "lm_head); all its layers unless --layers. The same seed every time: the same model")
      ->group(g);
  s->layers_opt = cmd->add_option("--layers", s->layers, "With --synthetic: only the first N layers (0: all)")
                      ->check(integer_between(0, 2147483647))
                      ->group(g);
  s->experts_opt = cmd->add_option("--experts", s->experts,
                                   "With --synthetic: the routed experts' format, bf16 (default), q8, q4 (as flashmoe "
                                   "pack writes them) or fp8 (E4M3 in 128x128 blocks, as Qwen's FP8 releases store them)")
                       ->group(g);
  s->weights_opt = cmd->add_option("--weights", s->weights,
                                   "With --synthetic: bf16 (default), or fp8: every linear weight an FP8 release "
                                   "converts (projections, shared and routed experts) in E4M3 128x128 blocks; "
                                   "embedding, lm_head and router stay bf16")
                       ->group(g);
  s->group_opt = cmd->add_option("--group", s->group, "With --synthetic --experts q8|q4: quantisation group size (default 64)")
                     ->check(integer_between(1, 2147483647))
                     ->group(g);
}

void check_synthetic_options(const std::string& command, const SyntheticOptions& s, const ModelOptions& model) {
  if (model.model_dir.empty() == s.name.empty())
    fail(s.name.empty() ? command + ": give a model with -m/--model, or --synthetic"
                        : command + ": give either -m/--model or --synthetic, not both");
  if (s.name.empty()) {
    if (s.experts_opt->count() || s.group_opt->count() || s.weights_opt->count())
      fail(command + ": --experts, --weights and --group are for --synthetic (a model's weights are in the format it "
                     "was stored or packed in)");
    if (s.layers_opt->count()) fail(command + ": --layers is for --synthetic (a model from -m runs all its layers)");
    return;
  }
  if (s.weights != "bf16" && s.weights != "fp8")
    fail(command + " --weights: unknown weight format '" + s.weights + "' (expected bf16 or fp8)");
  const bool fp8 = s.weights == "fp8";
  if (fp8 && s.experts_opt->count() && s.experts != "fp8")
    fail(command + ": --weights fp8 makes the routed experts fp8 too; leave out --experts " + s.experts);
  if (s.group_opt->count() && (fp8 || s.experts == "fp8"))
    fail(command + ": --group is for --experts q8|q4 (FP8 blocks are 128x128)");
}

ModelConfig synthetic_config(const SyntheticOptions& s, const ModelOptions& opt) {
  std::error_code ec;
  ModelConfig c;
  if (std::filesystem::exists(s.name, ec)) {
    c = load_model_config(s.name);
  } else {
    bool known = false;
    for (const std::string& p : model_preset_names()) known = known || p == s.name;
    if (!known) {
      std::string names;
      for (const std::string& p : model_preset_names()) names += (names.empty() ? "" : ", ") + p;
      fail("--synthetic: unknown model '" + s.name + "' (expected one of " + names +
           ", or a config.json or a directory holding one)");
    }
    c = model_preset(s.name);
  }
  if (s.layers > c.num_layers)
    fail("--layers " + std::to_string(s.layers) + " is more than " + s.name + "'s " + std::to_string(c.num_layers) +
         " layers");
  if (s.layers > 0) {
    c.num_layers = s.layers;
    c.layer_kinds.resize(size_t(s.layers));
    c.layer_is_moe.resize(size_t(s.layers));
  }
  if (opt.experts.experts_per_token > 0) limit_experts_per_token(&c, opt.experts.experts_per_token);
  return c;
}

std::unique_ptr<Backend> build_synthetic_model(const ModelOptions& opt, const SyntheticOptions& s, bool mtp_head,
                                               std::string* what) {
  const ModelConfig c = synthetic_config(s, opt);
  const bool fp8_weights = s.weights == "fp8";
  const QuantKind q = fp8_weights ? QuantKind::Fp8Block : parse_expert_format(s.experts, "--experts");
  const std::string ex = q == QuantKind::None       ? std::string()
                         : q == QuantKind::Fp8Block ? ", fp8 experts in 128x128 blocks"
                                                    : ", " + s.experts + " experts in groups of " + std::to_string(s.group);
  *what = "synthetic " + s.name +
          (fp8_weights ? " (random FP8 weights in 128x128 blocks; embedding, lm_head and router bf16"
                       : " (random bf16 weights" + ex) +
          ", " + std::to_string(c.num_layers) + " layers" +
          (opt.experts.experts_per_token > 0 ? ", --moe-top-k " + std::to_string(c.num_experts_per_tok) : std::string()) +
          (mtp_head ? ", a random MTP head" : "") + ")";
  const DeviceRequest& d = opt.device;
  if (d.device == "cpu") {
    ThreadPool pool(opt.threads);
    return synthetic_cpu_backend(c, q, s.group, pool, fp8_weights, mtp_head);
  }
  const Obstacle gpu = gpu_presence();
  if (gpu) fail(device_words(d) + ": no usable GPU (" + gpu.message + "); " + device_advice(DeviceFailure::Unavailable));
  return synthetic_backend(c, q, s.group, d.gpu, fp8_weights, mtp_head);
}

}  // namespace flashmoe::cli
