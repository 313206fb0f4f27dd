// flashmoe pack: rewrite an HF checkpoint into the expert-streaming layout.
#include <unistd.h>

#include <cstdio>

#include "cli/command.h"
#include "format/model_files.h"
#include "core/error.h"
#include "experts/expert_layout.h"
#include "experts/pack.h"

namespace flashmoe::cli {
namespace {

Registrar reg(20, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("pack", "Pack an HF checkpoint for expert streaming (per-layer expert files + manifest)");
  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto format = std::make_shared<std::string>("bf16");
  auto group = std::make_shared<int>(64);
  cmd->add_option("-m,--model", *in, "HF model directory (config.json + safetensors)")->required();
  cmd->add_option("-o,--output", *out, "Output directory (must not exist)")->required();
  cmd->add_option("--experts", *format, "Expert format: bf16 (default), q8, q4 (group-wise affine, MLX layout)");
  cmd->add_option("--group", *group, "Quantisation group size along the input dimension (default 64)")
      ->check(CLI::PositiveNumber);
  cmd->callback([=] {
    PackOptions opt;
    opt.experts = parse_expert_format(*format, "--experts");
    opt.group = *group;
    const bool tty = ::isatty(2);
    const ModelFiles files = resolve_model_files(*in);
    for (const std::string* f : {&files.tokenizer_json, &files.tokenizer_config})
      if (!f->empty()) opt.extra_files.push_back(*f);
    pack_model(files.model_dir, *out, opt, [&](int64_t done, int64_t total) {
      const int width = 30, filled = int(width * done / total);
      std::fprintf(stderr, "%spacking experts [%.*s%*s] %lld/%lld layers%s", tty ? "\r" : "", filled,
                   "##############################", width - filled, "", (long long)done, (long long)total,
                   tty && done < total ? "" : "\n");
      std::fflush(stderr);
    });
    std::fprintf(stderr, "packed %s -> %s (experts %s)\n", in->c_str(), out->c_str(), format->c_str());
  });
});

}  // namespace
}  // namespace flashmoe::cli
