// flashmoe logits: run ids as one prompt, write every position's logits.
#include "cli/command.h"
#include "cli/common.h"
#include "core/error.h"
#include "engine/session.h"
#include "format/safetensors.h"

namespace flashmoe::cli {
namespace {

Registrar reg_logits(10, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "Run token ids as one prompt and write the logits of every position");
  auto opt = std::make_shared<ModelOptions>();
  auto ids = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto hidden = std::make_shared<bool>(false);
  add_model_options(cmd, opt.get());
  cmd->add_flag("--hidden", *hidden, "Also write tensor 'hidden' [layers+1, N, H]: the residual stream after each layer");
  cmd->add_option("--ids", *ids, "Comma-separated token ids")->required();
  cmd->add_option("-o,--output", *out, "Output safetensors file (tensor 'logits', F32 [N, vocab])")->required();
  cmd->callback([opt, ids, out, hidden] {
    if (*hidden) opt->device.cpu_only = "--hidden";  // the CUDA backend keeps no per-layer residuals
    finalize_model_options(opt.get());
    std::vector<int32_t> tok = parse_ids(*ids);
    std::unique_ptr<Backend> backend = load_model(*opt);
    const ModelConfig& c = backend->config();
    ThreadPool pool(opt->threads);
    const int64_t n = int64_t(tok.size());
    std::vector<float> logits(size_t(n * c.vocab_size));
    std::vector<std::vector<float>> layers;
    auto st = backend->new_state(opt->kv);
    if (*hidden) backend->forward_capturing(*st, tok.data(), n, LogitsMode::All, logits.data(), pool, &layers);
    else backend->forward(*st, tok.data(), n, LogitsMode::All, logits.data(), pool);
    std::vector<TensorToWrite> tensors = {{"logits", DType::F32, {n, c.vocab_size}, logits.data()}};
    std::vector<float> h;
    if (*hidden) {
      for (const auto& layer : layers) h.insert(h.end(), layer.begin(), layer.end());
      tensors.push_back({"hidden", DType::F32, {c.num_layers + 1, n, c.hidden_size}, h.data()});
    }
    write_safetensors(*out, tensors);
    print_expert_stats(*opt, *backend, "prefill:");
  });
});

}  // namespace
}  // namespace flashmoe::cli
