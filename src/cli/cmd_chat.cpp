// flashmoe chat: an interactive multi-turn conversation. The session keeps its
// state between turns: each turn feeds only the tokens the conversation added
// since the last one (the model's recurrent state cannot be rewound, so when
// the re-rendered history does not extend what was fed, it re-reads it).
#include <readline/history.h>
#include <readline/readline.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/common.h"
#include "cli/generation_options.h"
#include "cli/text_model.h"
#include "core/error.h"

namespace flashmoe::cli {
namespace {

std::atomic<bool> g_generating{false};
std::atomic<bool> g_cancel{false};

// Ctrl-C stops the answer being generated; at the prompt it clears the line.
void on_sigint(int) {
  if (g_generating.load()) {
    g_cancel.store(true);
    return;
  }
  rl_replace_line("", 0);
  rl_crlf();
  rl_on_new_line();
  rl_redisplay();
}

struct ChatArgs {
  ModelOptions model;
  GenerationFlags gen;
  std::string system;
  bool no_think = false;
};

bool read_line(bool tty, std::string* out) {
  if (!tty) return static_cast<bool>(std::getline(std::cin, *out));
  char* line = readline("> ");
  if (!line) return false;
  *out = line;
  if (!out->empty()) add_history(line);
  std::free(line);
  return true;
}

Registrar reg_chat(21, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("chat", "Interactive chat (/reset starts over, /quit leaves, Ctrl-C stops an answer)");
  auto a = std::make_shared<ChatArgs>();
  add_model_options(cmd, &a->model);
  cmd->add_option("--system", a->system, "System message");
  cmd->add_flag("--no-think", a->no_think, "Render the template with enable_thinking=false");
  add_generation_options(cmd, &a->gen);
  a->gen.n_predict = 512;
  cmd->callback([a] {
    finalize_model_options(&a->model);
    TextModel tm = load_text_model(a->model);
    const ChatTemplate& tmpl = tm.chat_template();
    GenerateOptions go = make_generate_options(a->gen, tm.files, tm.eos_ids(true), tm.backend->config().max_position_embeddings);
    go.cancel = &g_cancel;
    ThreadPool pool(a->model.threads);
    Session session(*tm.backend, a->model.kv, pool, go.spec_draft > 0);
    const bool tty = isatty(0) && isatty(1);
    std::signal(SIGINT, on_sigint);
    rl_catch_signals = 0;

    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    auto start_over = [&] {
      messages = nlohmann::ordered_json::array();
      if (!a->system.empty()) messages.push_back({{"role", "system"}, {"content", a->system}});
      session.reset();
    };
    start_over();
    if (tty) std::fprintf(stderr, "flashmoe chat: /reset starts over, /quit leaves, Ctrl-C stops an answer\n");
    std::string line;
    while (read_line(tty, &line)) {
      if (line.empty()) continue;
      if (line == "/quit" || line == "/exit") break;
      if (line == "/reset") {
        start_over();
        std::fprintf(stderr, "(conversation reset)\n");
        continue;
      }
      messages.push_back({{"role", "user"}, {"content", line}});
      std::vector<int32_t> ids = tm.tokenizer.encode(
          tmpl.render(messages, true, a->no_think ? std::optional<bool>(false) : std::nullopt));
      const auto& held = session.tokens();
      size_t reused = 0;
      if (held.size() <= ids.size() && std::equal(held.begin(), held.end(), ids.begin())) {
        reused = held.size();
      } else {
        session.reset();  // the history changed under us: read it again
      }
      std::vector<int32_t> fresh(ids.begin() + int64_t(reused), ids.end());
      g_cancel = false;
      g_generating = true;
      GenerateResult r;
      try {
        r = generate(session, tm.tokenizer, fresh, go, [](const std::string& piece) {
          std::fwrite(piece.data(), 1, piece.size(), stdout);
          std::fflush(stdout);
          return true;
        });
      } catch (const Error& e) {
        g_generating = false;
        // Scripted (stdin not a terminal): nobody can retry, so the first
        // failure ends the run with the usual one-line error and status 1.
        if (!tty) throw;
        // Interactive: the turn is dropped and the session has started over
        // (Session::feed resets on a failed forward pass); the user may retry.
        messages.erase(messages.end() - 1);
        std::fprintf(stderr, "error: %s\n", e.what());
        continue;
      }
      g_generating = false;
      std::fputc('\n', stdout);
      std::fflush(stdout);
      messages.push_back({{"role", "assistant"}, {"content", r.text}});
      std::fprintf(stderr, "[%zu prompt tokens reused, %zu new; %zu generated at %.1f tokens/s%s]\n", reused,
                   fresh.size(), r.ids.size(), double(r.ids.size()) / std::max(r.gen_seconds, 1e-9),
                   r.finish_reason == "cancelled" ? "; stopped" : "");
      if (go.spec_draft > 0 && a->model.stats) std::fprintf(stderr, "[%s]\n", r.spec.describe().c_str());
    }
  });
});

}  // namespace
}  // namespace flashmoe::cli
