// flashmoe serve: the OpenAI-compatible HTTP server (src/server/) over one
// model bundle. SIGINT/SIGTERM are taken by a dedicated thread (sigwait), so
// shutdown runs in ordinary code (sigtimedwait, polling a done flag so the
// thread also ends when listen() returns on its own): stop accepting, end the
// running requests with an error, let the transport write those answers.
#include <pthread.h>
#include <signal.h>

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cli/command.h"
#include "cli/validators.h"
#include "cli/common.h"
#include "cli/generation_options.h"
#include "cli/synthetic_options.h"
#include "cli/text_model.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "engine/sampler.h"
#include "server/request_guard.h"
#include "server/server.h"

namespace flashmoe::cli {
namespace {

struct ServeArgs {
  ModelOptions model;
  SyntheticOptions synthetic;
  std::string tokenizer;  // with --synthetic
  server::ServerConfig cfg;
  std::string alias;
  int64_t ctx_size = 0;
  size_t state_cache_mb = 4096;
  std::string chat_template;  // replaces the bundle's template
  double read_timeout_s = 30, write_timeout_s = 30;
  bool mtp = false;
  std::optional<int> spec_draft;
};

// --chat-template: a tokenizer_config.json (or a directory holding one), or
// a Jinja file; a Jinja file keeps the bundle's special tokens (eos_token...).
ChatTemplate load_template_override(const std::string& path, const std::optional<ChatTemplate>& bundled) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec) || path.ends_with(".json")) return ChatTemplate::load(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read the chat template " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::ordered_json specials = nlohmann::ordered_json::object();
  if (bundled) {
    if (!bundled->eos_token().empty()) specials["eos_token"] = bundled->eos_token();
    if (!bundled->bos_token().empty()) specials["bos_token"] = bundled->bos_token();
  }
  try {
    return ChatTemplate(ss.str(), specials);
  } catch (const Error& e) {
    fail(std::string(e.what()) + " (template from " + path + ")");
  }
}

std::string model_id(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  if (p.filename() == "config.json") p = p.parent_path();  // --synthetic DIR/config.json: DIR
  std::string id = p.filename().string();
  return id.empty() || id == "." ? "model" : id;
}

Registrar reg_serve(30, [](CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (chat/completions, completions, models, metrics)");
  auto a = std::make_shared<ServeArgs>();
  add_model_options(cmd, &a->model, /*require_model=*/false);
  add_synthetic_options(cmd, &a->synthetic);
  cmd->add_option("--tokenizer", a->tokenizer,
                  "With --synthetic: the tokenizer (a directory holding tokenizer.json, and tokenizer_config.json "
                  "for the chat template; or the file) that turns requests into ids and ids into text; ids of the "
                  "model it does not have come out as the text <|id_N|>")
      ->group("Synthetic model");
  const char* g = "Server";
  cmd->add_option("--host", a->cfg.host, "Address to bind (default 127.0.0.1: this machine only)")->group(g);
  cmd->add_option("--port", a->cfg.port, "Port (default 8080; 0: any free port, printed at startup)")
      ->check(integer_between(0, 65535))->group(g);
  cmd->add_option("--api-key", a->cfg.api_keys,
                  "Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health; "
                  "repeat for several keys, whose stored conversation states are kept apart")
      ->allow_extra_args(false)->group(g);
  cmd->add_option("--cors-origin", a->cfg.cors_origins,
                  "Let web pages from ORIGIN (e.g. http://localhost:3000; '*': any) call the server; repeatable. "
                  "Without it, requests carrying an Origin header are refused (403)")
      ->allow_extra_args(false)->group(g);
  cmd->add_option("--alias", a->alias, "Model id in requests and /v1/models (default: the model directory's name)")->group(g);
  cmd->add_option("--parallel", a->cfg.parallel,
                  "Requests generating at once (default 1): the largest batch; each step of the model runs the next "
                  "token of every one of them (and prompt chunks) as one batched forward pass on all threads")
      ->check(integer_between(1, 256))->group(g);
  cmd->add_option("--batch-tokens", a->cfg.batch_tokens,
                  "Tokens per step (default 512): every generating request's next token, then chunks of waiting "
                  "prompts up to this total (at least 16 prompt tokens), so a long prompt delays the others by at "
                  "most one such step per token")
      ->check(integer_between(1, 65536))->group(g);
  cmd->add_option("--batch-gather", a->cfg.batch_gather_us,
                  "Microseconds a step waits, after the previous one, for running requests that have not handed in "
                  "their next token (default 3000; half the previous step if that is longer); those later join the "
                  "next step. A GPU's steps are far shorter than a CPU's: a smaller value keeps one late request "
                  "from holding up the rest")
      ->check(integer_between(0, 1000000))->group(g);
  cmd->add_option("--queue", a->cfg.queue, "Requests waiting for a free slot before answering 503 (default 32)")
      ->check(integer_between(0, 4096))->group(g);
  cmd->add_option("--max-body", a->cfg.max_body,
                  "Largest request body in bytes, chunked or not; larger gets 413 before it is read (default 1048576)")
      ->check(integer_at_least(1))->group(g);
  cmd->add_option("--read-timeout", a->read_timeout_s,
                  "Seconds a client has to send a whole request, headers and body (not renewed by each byte); "
                  "also how long an idle connection is kept (default 30)")
      ->check(between(0.05, 86400))->group(g);
  cmd->add_option("--write-timeout", a->write_timeout_s,
                  "Seconds a client may leave a response unread before it is dropped (default 30)")
      ->check(between(0.05, 86400))->group(g);
  cmd->add_option("--state-cache", a->cfg.state_cache, "Conversation state snapshots kept for reuse, LRU (default 32; 0: off)")
      ->check(integer_at_least(0))->group(g);
  cmd->add_option("--state-cache-mb", a->state_cache_mb, "Memory the state snapshots may hold, MiB (default 4096)")
      ->check(integer_at_least(1))->group(g);
  cmd->add_option("--max-tokens", a->cfg.max_tokens,
                  "Default for a request's max_tokens, and the most it may ask for (more gets 400) (default 4096)")
      ->check(integer_between(1, 2147483647))->group(g);
  cmd->add_option("--chat-template", a->chat_template,
                  "Chat template to use instead of the bundle's: a tokenizer_config.json or a Jinja file")
      ->check(CLI::ExistingPath)->group(g);
  cmd->add_flag("--log-requests", a->cfg.access_log, "Print one line per request (method, endpoint, status) to stderr")->group(g);
  add_speculative_options(cmd, &a->mtp, &a->spec_draft);
  cmd->add_option("-c,--ctx-size", a->ctx_size, "Context limit in tokens (default: the model's max_position_embeddings)")
      ->check(integer_at_least(0))->group(g);
  cmd->callback([a] {
    finalize_model_options(&a->model);
    check_synthetic_options("serve", a->synthetic, a->model);
    if (a->synthetic.given() && a->tokenizer.empty())
      fail("serve --synthetic needs --tokenizer DIR: a synthetic model has no tokenizer of its own (e.g. the real "
           "model's directory, or models/coder-mini)");
    if (!a->synthetic.given() && !a->tokenizer.empty())
      fail("serve: --tokenizer is for --synthetic (a model from -m brings its own tokenizer)");
    // Before any thread exists, so every thread inherits the mask and only
    // the waiter below sees these signals.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
    signal(SIGPIPE, SIG_IGN);
    // Each connection is a descriptor: take the hard limit, not the usual
    // soft 1024, so a burst of clients is accepted rather than refused.
    rlimit fds{};
    if (getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur < fds.rlim_max) {
      fds.rlim_cur = fds.rlim_max;
      setrlimit(RLIMIT_NOFILE, &fds);
    }

    std::string what;
    TextModel tm = a->synthetic.given() ? load_synthetic_text_model(a->model, a->synthetic, a->tokenizer, &what)
                                        : load_text_model(a->model);
    if (!a->chat_template.empty()) tm.chat.emplace(load_template_override(a->chat_template, tm.chat));
    server::ServedModel sm;
    sm.id = !a->alias.empty() ? a->alias : model_id(a->synthetic.given() ? a->synthetic.name : a->model.model_dir);
    sm.backend = tm.backend.get();
    sm.tokenizer = &tm.tokenizer;
    sm.chat = tm.chat ? &*tm.chat : nullptr;
    sm.kv = a->model.kv;
    sm.spec_draft = spec_draft_from_flags(a->mtp, a->spec_draft);
    if (sm.spec_draft > 0) tm.backend->new_drafting_state(sm.kv);  // no head, no CPU: the error now, not per request
    SamplingParams base;
    base.temperature = 0.7f;  // when generation_config.json does not say
    base.top_p = 0.95f;
    sm.defaults = tm.files.generation_config.empty() ? base : load_generation_config(tm.files.generation_config, base);
    sm.eos_chat = tm.eos_ids(true);
    sm.eos_text = tm.eos_ids(false);
    for (auto* v : {&sm.eos_chat, &sm.eos_text})
      for (int32_t e : sm.defaults.eos_ids)
        if (std::find(v->begin(), v->end(), e) == v->end()) v->push_back(e);
    int64_t model_ctx = tm.backend->config().max_position_embeddings;
    sm.context = a->ctx_size > 0 ? std::min(a->ctx_size, model_ctx) : model_ctx;

    a->cfg.state_cache_bytes = a->state_cache_mb << 20;
    a->cfg.read_timeout_ms = int64_t(a->read_timeout_s * 1000);
    a->cfg.write_timeout_ms = int64_t(a->write_timeout_s * 1000);
    a->cfg.threads = a->model.threads > 0 ? a->model.threads : ThreadPool::hardware_threads();
    server::HttpServer srv(a->cfg, sm);
    int port = srv.bind();
    const std::string device = sm.backend->label();
    if (!what.empty()) std::fprintf(stderr, "flashmoe serve: %s; tokenizer %s\n", what.c_str(), a->tokenizer.c_str());
    std::fprintf(stderr,
                 "flashmoe serve: model '%s' on http://%s:%d (device %s, %d threads, batches of up to %d requests "
                 "and %lld tokens per step, queue %d, state cache %zu, context %lld)\n",
                 sm.id.c_str(), a->cfg.host.c_str(), port, device.c_str(), a->cfg.threads, a->cfg.parallel,
                 (long long)a->cfg.batch_tokens, a->cfg.queue, a->cfg.state_cache, (long long)sm.context);
    if (a->cfg.api_keys.empty() && !server::is_loopback_host(a->cfg.host))
      std::fprintf(stderr, "flashmoe serve: warning: listening on %s without --api-key; anyone who can reach it can use it\n",
                   a->cfg.host.c_str());
    std::fflush(stderr);

    std::atomic<bool> done{false};
    std::thread waiter([&srv, &done, sigs] {
      timespec tick{0, 200 * 1000 * 1000};
      while (!done) {
        if (sigtimedwait(&sigs, nullptr, &tick) > 0) {
          srv.stop();
          return;
        }
      }
    });
    bool ok = srv.listen();
    done = true;
    waiter.join();
    std::fprintf(stderr, "flashmoe serve: stopped\n");
    if (!ok) fail("the server stopped with an error");
  });
});

}  // namespace
}  // namespace flashmoe::cli
