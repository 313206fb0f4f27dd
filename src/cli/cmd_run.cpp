// flashmoe run: text in, text out. Streams the continuation of a prompt to
// stdout as it is generated; prompt and generation speeds go to stderr.
#include <cstdio>

#include "cli/command.h"
#include "cli/common.h"
#include "cli/generation_options.h"
#include "cli/text_model.h"
#include "core/error.h"

namespace flashmoe::cli {
namespace {

struct RunArgs {
  ModelOptions model;
  GenerationFlags gen;
  std::string prompt, system;
  bool chat = false, no_think = false, show_prompt = false;
};

Registrar reg_run(20, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "Generate text from a prompt, streamed to stdout");
  auto a = std::make_shared<RunArgs>();
  add_model_options(cmd, &a->model);
  cmd->add_option("-p,--prompt", a->prompt, "Prompt text")->required();
  cmd->add_flag("--chat", a->chat, "Wrap the prompt in the model's chat template as a user message");
  cmd->add_option("--system", a->system, "System message (with --chat)");
  cmd->add_flag("--no-think", a->no_think, "With --chat: render the template with enable_thinking=false");
  cmd->add_flag("--show-prompt", a->show_prompt, "Print the prompt (as fed, after templating) before the continuation");
  add_generation_options(cmd, &a->gen);
  cmd->callback([a] {
    finalize_model_options(&a->model);
    if (a->prompt.empty()) fail("the prompt is empty (-p \"...\")");
    TextModel tm = load_text_model(a->model);
    std::string text = a->prompt;
    if (a->chat) text = tm.render_user_turn(a->system, a->prompt, a->no_think);
    else if (!a->system.empty()) fail("--system needs --chat");
    std::vector<int32_t> ids = tm.tokenizer.encode(text);
    GenerateOptions go = make_generate_options(a->gen, tm.files, tm.eos_ids(a->chat), tm.backend->config().max_position_embeddings);
    go.keep_output = false;  // streamed to stdout as it comes; a long run need not hold it
    ThreadPool pool(a->model.threads);
    Session session(*tm.backend, a->model.kv, pool, go.spec_draft > 0);
    // Nothing reads the token list unless a penalty is on: without one, a
    // long run with a bounded KV cache keeps flat memory (bench/soak.sh).
    session.set_record_tokens(go.sampling.uses_history());
    if (a->show_prompt) std::fwrite(text.data(), 1, text.size(), stdout);
    GenerateResult r = generate(session, tm.tokenizer, ids, go, [](const std::string& piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return true;
    });
    std::fputc('\n', stdout);
    std::fflush(stdout);
    print_expert_stats(a->model, *tm.backend, nullptr);  // the stats line names itself
    std::fprintf(stderr, "\nprompt: %lld tokens in %.3f s (%.1f tokens/s)\ngeneration: %lld tokens in %.3f s (%.1f tokens/s), finish: %s\n",
                 (long long)r.prompt_tokens, r.prompt_seconds, double(r.prompt_tokens) / std::max(r.prompt_seconds, 1e-9),
                 (long long)r.generated, r.gen_seconds, double(r.generated) / std::max(r.gen_seconds, 1e-9),
                 r.finish_reason.c_str());
    if (go.spec_draft > 0) std::fprintf(stderr, "%s\n", r.spec.describe().c_str());
  });
});

}  // namespace
}  // namespace flashmoe::cli
