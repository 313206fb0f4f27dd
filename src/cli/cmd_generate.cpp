// flashmoe generate: continue token ids (greedy), printing the new ids.
#include <chrono>
#include <cstdio>

#include "cli/command.h"
#include "cli/validators.h"
#include "cli/common.h"
#include "cli/generation_options.h"
#include "cli/synthetic_options.h"
#include "engine/speculative.h"

namespace flashmoe::cli {
namespace {

Registrar reg_generate(11, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Continue a prompt given as token ids");
  auto opt = std::make_shared<ModelOptions>();
  auto ids = std::make_shared<std::string>();
  auto n = std::make_shared<int>(32);
  auto greedy = std::make_shared<bool>(false);
  auto print_ids = std::make_shared<bool>(false);
  auto mtp = std::make_shared<bool>(false);
  auto draft = std::make_shared<std::optional<int>>();
  auto synthetic = std::make_shared<SyntheticOptions>();
  add_model_options(cmd, opt.get(), /*require_model=*/false);
  add_synthetic_options(cmd, synthetic.get());
  cmd->add_option("--ids", *ids, "Comma-separated prompt token ids")->required();
  cmd->add_option("-n,--n-predict", *n, "Number of tokens to generate")->check(integer_between(0, 2147483647));
  cmd->add_flag("--greedy", *greedy, "Greedy decoding (argmax); the only mode of this command");
  cmd->add_flag("--print-ids", *print_ids, "Print the generated ids on one line, space-separated");
  add_speculative_options(cmd, mtp.get(), draft.get());
  // Every option's storage is captured explicitly: CLI11 writes flags through
  // these pointers, so each must live as long as the command does.
  cmd->callback([opt, synthetic, ids, n, greedy, print_ids, mtp, draft] {
    const int spec_draft = spec_draft_from_flags(*mtp, *draft);
    finalize_model_options(opt.get());
    check_synthetic_options("generate", *synthetic, *opt);
    std::vector<int32_t> tok = parse_ids(*ids);
    std::string what;
    std::unique_ptr<Backend> backend =
        synthetic->given() ? build_synthetic_model(*opt, *synthetic, spec_draft > 0, &what) : load_model(*opt);
    ThreadPool pool(opt->threads);
    Session s(*backend, opt->kv, pool, spec_draft > 0);
    SpecStats spec;
    std::vector<int32_t> gen;
    double decode_s = 0;
    if (*n > 0) {
      const std::vector<float>& last = s.feed(tok);
      print_expert_stats(*opt, *backend, "prefill:");
      backend->reset_expert_stats();  // decode numbers on their own
      auto t0 = std::chrono::steady_clock::now();
      gen = spec_draft > 0 ? greedy_speculative(s, last, *n, spec_draft, &spec) : s.greedy(*n);
      decode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    for (size_t i = 0; i < gen.size(); ++i) std::printf("%s%d", i ? " " : "", gen[i]);
    std::printf("\n");
    if (opt->stats && *n > 1) {
      std::fprintf(stderr, "decode: %d tokens in %.3f s, %.2f tokens/s\n", *n - 1, decode_s, double(*n - 1) / decode_s);
      print_expert_stats(*opt, *backend, "decode: ");
      if (spec_draft > 0) std::fprintf(stderr, "%s\n", spec.describe().c_str());
    }
  });
});

}  // namespace
}  // namespace flashmoe::cli
