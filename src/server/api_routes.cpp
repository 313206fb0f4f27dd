#include "server/api_routes.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>
#include <random>

#include "core/error.h"
#include "engine/batch_scheduler.h"
#include "engine/generator.h"
#include "engine/json_schema_grammar.h"
#include "engine/session.h"
#include "engine/token_constraint.h"
#include "kv/memory_calc.h"
#include "server/anthropic_api.h"
#include "server/chat_output.h"
#include "server/chat_prompt.h"
#include "server/ids.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/openai_response.h"
#include "server/request_guard.h"
#include "server/slots.h"
#include "server/state_cache.h"

namespace flashmoe::server {

using json = nlohmann::ordered_json;

namespace {

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Compares without an early exit, so the key cannot be guessed byte by byte
// from response times.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= (unsigned char)(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

bool out_of_device_memory(const std::exception& e) {
  const auto* d = dynamic_cast<const DeviceError*>(&e);
  return d && d->kind() == DeviceFailure::OutOfMemory;
}

// What a client is told when the model fails on its request; the details
// (file names) stay in the log.
std::string model_failure_message(const std::exception& e) {
  return out_of_device_memory(e) ? "the GPU is out of memory for this request; try again later"
                                 : "the model failed on this request (the server's log has the reason)";
}

void log_failure(const std::exception& e) {
  std::fprintf(stderr, "flashmoe serve: error: a request failed: %s\n", e.what());
  std::fflush(stderr);
}

HttpResponse error_of(const ApiError& e) {
  HttpResponse res;
  res.status = e.status;
  res.body = error_body(e);
  return res;
}

HttpResponse json_response(const json& j) {
  HttpResponse res;
  res.body = j.dump(-1, ' ', false, json::error_handler_t::replace);
  return res;
}

// Metrics label: the known routes by name, everything else as "other".
std::string endpoint_label(const std::string& path) {
  for (const char* p : {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                        "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize"})
    if (path == p) return p;
  return "other";
}

std::string sse(const json& j) { return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n"; }

// The API a generation request came in through: it decides the request
// parser, the response shapes and the error shape.
enum class Api { Chat, Completions, Anthropic };

HttpResponse anthropic_error_of(const ApiError& e) {
  HttpResponse res;
  res.status = e.status;
  res.body = anthropic_error_body(e.status, e.what());
  return res;
}

std::string anthropic_error_event(const std::string& message) {
  return "event: error\ndata: " + anthropic_error_body(500, message) + "\n\n";
}


}  // namespace

// One prepared completion: validated, templated and tokenized, ready to run.
struct Job {
  Api api = Api::Chat;
  CompletionRequest req;
  ChatPrompt prompt;         // chat: the rendered prompt and what the output parser needs
  std::string partition;     // state-cache partition: the API key's and cache_salt's
  std::vector<int32_t> ids;  // the whole prompt
  size_t boundary = 0;       // end of the last complete message (snapshot point), 0: none
  GenerateOptions go;
  std::shared_ptr<TokenConstraint> constraint;  // response_format; go.constraint points here
  std::string id;
  int64_t created = 0;
};

struct Outcome {
  GenerateResult r;
  int64_t reused = 0;
  // run(.., store_later): stores the finished conversation (empty when there
  // is nothing to store); until called (or dropped), the cache's find()
  // waits for it where it would be the better match.
  std::function<void()> store;
};

struct ApiRoutes::Impl {
  ServerConfig cfg;
  ServedModel m;
  // Every request's forward passes run as steps of one scheduler on one
  // pool of all the threads (continuous batching).
  ThreadPool threads;
  BatchScheduler scheduler;
  SlotPool slots;
  StateCache cache;
  Metrics metrics;
  OriginPolicy origins;
  std::atomic<bool> stopping{false};
  // Set when the model failed on a request (a corrupt expert file, a device
  // error), cleared by the next request it completes: /health reports it.
  std::atomic<bool> model_failing{false};
  std::once_flag vocab_once;  // the constraint vocabulary (tries), built for the first response_format
  std::shared_ptr<const TokenVocabulary> constraint_vocab;

  Impl(const ServerConfig& c, const ServedModel& model)
      : cfg(c), m(model), threads(std::max(cfg.threads, 1)),
        scheduler(*m.backend, threads, BatchSchedulerOptions{cfg.batch_tokens, std::chrono::microseconds(cfg.batch_gather_us)}), slots(cfg.parallel, cfg.queue),
        cache(cfg.state_cache, cfg.state_cache_bytes), origins{cfg.host, cfg.cors_origins} {}

  // The state bytes of a running request, for the gauges.
  void report(SlotPool::Lease& lease, const Session& s) const {
    const StateBytes b = s.state().bytes();
    lease.report(b.kv, b.recurrent);
  }

  // ---- request -> job ----

  Job prepare(CompletionRequest req, Api api, const std::string& key_partition) {
    Job j;
    j.api = api;
    j.req = std::move(req);
    const CompletionRequest& q = j.req;
    const bool chat = q.chat;
    if (q.max_tokens && *q.max_tokens > cfg.max_tokens)
      throw ApiError(400,
                     "'max_tokens' is " + std::to_string(*q.max_tokens) + "; this server allows at most " +
                         std::to_string(cfg.max_tokens) + " (its --max-tokens)",
                     "invalid_request_error", "", "max_tokens");
    // Length-prefixed, so no key and salt pair can spell another's.
    j.partition = key_partition + std::to_string(q.cache_salt.size()) + ":" + q.cache_salt;
    if (!q.model.empty() && q.model != m.id)
      throw ApiError(api == Api::Anthropic ? 404 : 400,
                     "the model '" + q.model + "' does not exist; this server serves '" + m.id + "'",
                     "invalid_request_error", "model_not_found", "model");
    std::string text, head;
    if (chat) {
      if (!m.chat) throw ApiError(400, "this model has no chat template; use /v1/completions");
      j.prompt = build_chat_prompt(*m.chat, q);
      text = j.prompt.text;
      head = j.prompt.head;
    } else {
      text = q.prompt;
    }
    try {
      j.ids = m.tokenizer->encode(text);
      if (chat) {
        std::vector<int32_t> h = m.tokenizer->encode(head);
        if (h.size() < j.ids.size() && std::equal(h.begin(), h.end(), j.ids.begin())) j.boundary = h.size();
      }
    } catch (const Error&) {
      throw ApiError(400, "the input could not be tokenized (is it valid UTF-8?)");
    }
    if (j.ids.empty()) throw ApiError(400, "the prompt is empty");
    if (int64_t(j.ids.size()) >= m.context)
      throw ApiError(400,
                     "the prompt is " + std::to_string(j.ids.size()) + " tokens; this server's context is " +
                         std::to_string(m.context) + " tokens (prompt plus at least one generated token)",
                     "invalid_request_error", "context_length_exceeded", chat ? "messages" : "prompt");

    SamplingParams p = m.defaults;
    if (q.temperature) p.temperature = *q.temperature;
    if (q.top_p) p.top_p = *q.top_p;
    if (q.top_k) p.top_k = *q.top_k < 0 ? 0 : *q.top_k;
    if (q.min_p) p.min_p = *q.min_p;
    if (q.repetition_penalty) p.repetition_penalty = *q.repetition_penalty;
    p.presence_penalty = q.presence_penalty;
    p.frequency_penalty = q.frequency_penalty;
    const size_t vocab = size_t(m.backend->config().vocab_size);
    for (const auto& [id, bias] : q.logit_bias)
      if (size_t(id) >= vocab)
        throw ApiError(400, "'logit_bias' names token " + std::to_string(id) + "; this model's vocabulary has " +
                                std::to_string(vocab) + " tokens", "invalid_request_error", "", "logit_bias");
    p.logit_bias = q.logit_bias;
    p.seed = q.seed ? *q.seed : std::random_device{}();
    p.eos_ids = q.ignore_eos ? std::vector<int32_t>{} : (chat ? m.eos_chat : m.eos_text);
    j.go.sampling = p;
    j.go.max_new_tokens = int(q.max_tokens.value_or(cfg.max_tokens));
    j.go.stop = q.stop;
    j.go.context_limit = m.context;
    j.go.cancel = &stopping;
    j.go.top_logprobs = q.top_logprobs;
    j.go.spec_draft = m.spec_draft;
    if (!q.response_format.is_null()) {
      std::call_once(vocab_once, [&] { constraint_vocab = std::make_shared<const TokenVocabulary>(*m.tokenizer); });
      try {
        j.constraint = make_json_constraint(q.response_format, constraint_vocab);
      } catch (const JsonSchemaError& e) {
        throw ApiError(400, e.what(), "invalid_request_error", "", "response_format");
      }
      j.go.constraint = j.constraint.get();
    }
    j.id = random_id(api == Api::Anthropic ? "msg_" : chat ? "chatcmpl-" : "cmpl-");
    j.created = unix_time();
    return j;
  }

  // ---- running a job on a slot ----

  // Starts from the longest stored snapshot the prompt extends, feeds up to
  // the last complete message (and stores that point), then generates; the
  // finished conversation (prompt + answer) is stored too, before run()
  // returns or, with store_later, by Outcome::store (a stream calls it after
  // its last event: a copy to host memory of a large model's state, ~60 MB
  // for the 35B, takes tens of milliseconds that the client need not wait
  // for; on a GPU within its VRAM budget the copy stays in device memory and
  // costs microseconds).
  Outcome run(Job& j, SlotPool::Lease& lease, const std::function<bool(const std::string&)>& on_text,
              const std::function<void(const TokenLogprob&)>& on_logprob, bool store_later = false,
              std::function<bool()> client_gone = {}) {
    Outcome out;
    // The session's forward passes join the scheduler's steps: its prompt
    // in chunks within the step budget, then one token per step, batched
    // with every other running request (with --mtp, each verify pass too).
    auto session = std::make_shared<Session>(scheduler, m.kv, m.spec_draft > 0);
    Session& s = *session;
    // Asked before each step while a prompt is still being read (the
    // generate loop asks go.cancel and the writes fail for each token): a
    // shutdown, or a streaming client that has gone, ends the request then.
    s.set_cancel([this, gone = std::move(client_gone)] { return stopping.load() || (gone && gone()); });
    // No copy that the cache would not keep (--state-cache 0, over the budget).
    auto worth_storing = [this](const Session& x) {
      const StateBytes b = x.state().bytes();
      return cache.would_keep(size_t(b.kv + b.recurrent) + x.tokens().size() * sizeof(int32_t));
    };
    auto store = [&] {
      if (worth_storing(s)) cache.put(s.snapshot(), j.partition);
    };
    size_t fed = 0;
    if (auto snap = cache.find(j.ids, j.partition)) {
      s.restore(*snap);
      fed = snap->tokens.size();
      out.reused = int64_t(fed);
    }
    double head_seconds = 0;
    if (j.boundary > fed) {  // split there even without a cache, so results do not depend on it
      auto t0 = std::chrono::steady_clock::now();
      try {
        s.feed(std::vector<int32_t>(j.ids.begin() + std::ptrdiff_t(fed), j.ids.begin() + std::ptrdiff_t(j.boundary)));
      } catch (const ForwardCancelled&) {
        s.leave_batch();
        out.r.finish_reason = "cancelled";
        out.r.prompt_tokens = int64_t(j.ids.size());
        metrics.count_generation(int64_t(j.ids.size()), out.reused, 0, 0, 0, true);
        return out;
      }
      head_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      store();
      fed = j.boundary;
    }
    report(lease, s);
    int64_t since_report = 0;
    auto cb = [&](const std::string& piece) {
      if (++since_report >= 16) {  // keep the memory gauges roughly current
        report(lease, s);
        since_report = 0;
      }
      return on_text(piece);
    };
    GenerateOptions go = j.go;
    go.on_logprob = on_logprob;
    out.r = generate(s, *m.tokenizer, std::vector<int32_t>(j.ids.begin() + std::ptrdiff_t(fed), j.ids.end()), go, cb);
    out.r.prompt_seconds += head_seconds;
    out.r.prompt_tokens = int64_t(j.ids.size());
    bool cancelled = out.r.finish_reason == "cancelled";
    model_failing = false;
    // Done with the steps: they need not wait for this session while its
    // state is copied out.
    s.leave_batch();
    if (!cancelled && store_later && worth_storing(s)) {
      auto pending = std::make_shared<StateCache::Pending>(cache, s.tokens(), j.partition);
      out.store = [this, session, pending, partition = j.partition] {
        cache.put(session->snapshot(), partition);
        pending->done();
      };
    } else if (!cancelled) {
      store();
    }
    metrics.count_generation(int64_t(j.ids.size()), out.reused, int64_t(out.r.ids.size()), out.r.prompt_seconds,
                             out.r.gen_seconds, cancelled);
    metrics.count_speculation(out.r.spec.rounds, out.r.spec.drafted, out.r.spec.accepted);
    return out;
  }

  // ---- responses ----

  json usage(const Job& j, const Outcome& o) const {
    int64_t n = o.r.generated;
    return {{"prompt_tokens", int64_t(j.ids.size())},
            {"completion_tokens", n},
            {"total_tokens", int64_t(j.ids.size()) + n},
            {"prompt_tokens_details", {{"cached_tokens", o.reused}}}};
  }

  // One answer being written: the generated text goes through the output
  // parser (chat: reasoning, content, tool calls) into the API's response
  // builder, which gives stream events or, at the end, the whole response.
  struct Answer {
    const Job& job;
    std::optional<ChatOutputParser> parser;
    std::optional<OpenAIResponseBuilder> openai;
    std::optional<AnthropicMessageBuilder> anthropic;

    Answer(const Job& j, const ServedModel& m) : job(j) {
      if (j.req.chat) {
        ChatOutputParser::Options po;
        po.in_reasoning = j.prompt.in_reasoning;
        po.tools = j.prompt.tools;
        po.tool_defs = j.req.tools;
        parser.emplace(po);
        parser->feed(j.prompt.prefill);  // a forced call's start: held until the call is complete
      }
      if (j.api == Api::Anthropic) anthropic.emplace(j.id, m.id, int64_t(j.ids.size()));
      else openai.emplace(j.req.chat, j.id, m.id, j.created, *m.tokenizer, j.req.top_logprobs >= 0);
    }

    std::vector<OutputEvent> events(const std::string& piece) {
      if (parser) return parser->feed(piece);
      return {{OutputEvent::Kind::Content, piece, {}}};
    }
    void logprob(const TokenLogprob& lp) {
      if (openai) openai->add_logprob(lp);
    }
    // Stream events for a piece of generated text ("" when nothing is ready).
    std::string stream_text(const std::string& piece) {
      std::vector<OutputEvent> ev = events(piece);
      if (anthropic) return anthropic->add(ev);
      std::string out;
      for (const json& c : openai->add(ev)) out += sse(c);
      return out;
    }
    // The parser's last events; then whether tool_choice is satisfied.
    std::string stream_flush() {
      if (!parser) return "";
      std::vector<OutputEvent> ev = parser->finish();
      if (anthropic) return anthropic->add(ev);
      std::string out;
      for (const json& c : openai->add(ev)) out += sse(c);
      return out;
    }
    bool tool_calls() const { return parser && parser->tool_calls() > 0; }
    // tool_choice required / named: the answer must be a call (of that tool).
    std::string tool_choice_failure() const {
      const CompletionRequest& q = job.req;
      if (q.tool_choice != ToolChoice::Required && q.tool_choice != ToolChoice::Named) return "";
      if (!tool_calls())
        return "the model did not produce a valid tool call although tool_choice requires one (its output was "
               "not a well-formed call)";
      for (const std::string& name : parser->tool_names()) {
        bool known = false;
        for (const auto& t : q.tools) known = known || t["function"]["name"] == name;
        if (!known) return "the model called '" + name + "', which is not one of the request's tools";
      }
      return "";
    }
    // A complete call is "tool_calls" even when the token limit ended the
    // answer right after it (as vLLM reports it).
    std::string openai_finish(const Outcome& o) const {
      if (tool_calls()) return "tool_calls";
      return o.r.finish_reason == "length" ? "length" : "stop";
    }
    std::string anthropic_stop(const Outcome& o) const {
      return anthropic_stop_reason(o.r.finish_reason, o.r.stop_string, tool_calls());
    }
  };

  // The model failed on a valid request: the server's fault, logged, and
  // /health says so until a request succeeds again.
  ApiError model_failure(const std::exception& e) {
    log_failure(e);
    if (!out_of_device_memory(e)) model_failing = true;
    return ApiError(out_of_device_memory(e) ? 503 : 500, model_failure_message(e), "server_error");
  }

  static std::string sse_error(const ApiError& e) { return "data: " + error_body(e) + "\n\n"; }

  // POST /v1/messages/count_tokens: the prompt's length in tokens, as the
  // Messages endpoint would build it (template, tools, forced call start).
  HttpResponse count_tokens(const HttpRequest& req) {
    try {
      if (req.body.empty())
        throw ApiError(400, "the request body is empty; send a JSON object (Content-Type: application/json)");
      Job j = prepare(parse_anthropic_request(req.body, /*count_tokens=*/true), Api::Anthropic, "");
      return json_response(json{{"input_tokens", int64_t(j.ids.size())}});
    } catch (const ApiError& e) {
      return anthropic_error_of(e);
    }
  }

  HttpResponse handle_generation(const HttpRequest& req, Api api, const std::string& key_partition) {
    auto fail = [api](const ApiError& e) { return api == Api::Anthropic ? anthropic_error_of(e) : error_of(e); };
    try {
      if (req.body.empty())
        throw ApiError(400, "the request body is empty; send a JSON object (Content-Type: application/json)");
      CompletionRequest q = api == Api::Anthropic ? parse_anthropic_request(req.body)
                                                  : parse_completion_request(req.body, api == Api::Chat);
      auto job = std::make_shared<Job>(prepare(std::move(q), api, key_partition));
      std::shared_ptr<SlotPool::Lease> lease = slots.acquire();
      if (!lease) {
        if (stopping) throw ApiError(503, "the server is shutting down", "server_error");
        throw ApiError(503, "the server is busy (all slots and the queue are full); retry later", "server_error");
      }
      if (!job->req.stream) {
        Answer a(*job, m);
        Outcome o = run(
            *job, *lease,
            [&](const std::string& piece) {
              a.stream_text(piece);  // non-streamed: the builder keeps it
              return true;
            },
            [&](const TokenLogprob& lp) { a.logprob(lp); });
        // Cancelled only by a shutdown: an unfinished answer is not a "stop".
        if (o.r.finish_reason == "cancelled")
          throw ApiError(503, "the server is shutting down; the request was not finished", "server_error");
        a.stream_flush();
        if (std::string why = a.tool_choice_failure(); !why.empty()) throw ApiError(500, why, "server_error");
        if (a.anthropic) return json_response(a.anthropic->message(a.anthropic_stop(o), o.r.stop_string, o.r.generated));
        return json_response(a.openai->response(a.openai_finish(o), usage(*job, o)));
      }
      HttpResponse res;
      res.content_type = "text/event-stream";
      res.headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
      res.stream = [this, job, lease](EventSink& sink) mutable {
        auto write = [&](const std::string& s) { return s.empty() || sink.write(s); };
        const bool anth = job->api == Api::Anthropic;
        auto error_event = [&](const ApiError& e) {
          write(anth ? anthropic_error_event(e.what()) : sse_error(e));
        };
        try {
          Answer a(*job, m);
          bool ok = write(anth ? a.anthropic->start_event() : sse(a.openai->first_chunk()));
          Outcome o;
          if (ok) {
            o = run(
                *job, *lease, [&](const std::string& piece) { return write(a.stream_text(piece)); },
                [&](const TokenLogprob& lp) { a.logprob(lp); }, /*store_later=*/true, [&] { return sink.gone(); });
          } else {
            metrics.count_generation(0, 0, 0, 0, 0, true);
          }
          // The conversation is stored after the last events (or when they
          // fail), then the slot is freed: its session (state) lives until then.
          struct StoreAtExit {
            std::function<void()> store;
            std::shared_ptr<SlotPool::Lease>& lease;
            ~StoreAtExit() {
              try {
                if (store) store();
              } catch (const std::exception& e) {
                log_failure(e);  // the answer was complete; only its reuse is lost
              }
              lease.reset();
            }
          } at_exit{std::move(o.store), lease};
          if (!ok) return;  // the client has gone
          if (o.r.finish_reason == "cancelled") {  // no finish chunk, no [DONE]
            // By a shutdown, or by the client's closed connection (seen by
            // poll() before a write failed; the event then goes nowhere).
            if (stopping)
              error_event(ApiError(503, "the server is shutting down; the answer was not finished", "server_error"));
            else
              error_event(ApiError(400, "the request was cancelled: the client closed its connection"));
            return;
          }
          if (!write(a.stream_flush())) return;
          if (std::string why = a.tool_choice_failure(); !why.empty()) {
            error_event(ApiError(500, why, "server_error"));
            return;
          }
          if (anth) {
            write(a.anthropic->finish_events(a.anthropic_stop(o), o.r.stop_string, o.r.generated));
            return;
          }
          write(sse(a.openai->finish_chunk(a.openai_finish(o))));
          if (job->req.include_usage) write(sse(a.openai->usage_chunk(usage(*job, o))));
          write("data: [DONE]\n\n");
        } catch (const std::exception& e) {
          lease.reset();
          error_event(model_failure(e));
        }
      };
      return res;
    } catch (const ApiError& e) {
      return fail(e);
    } catch (const Error& e) {
      // Requests are validated before they run (ApiError above), so an Error
      // here is the model failing: a corrupt or vanished expert file, the
      // GPU. The server's fault, not the client's: 5xx, and the reason goes
      // to the server's log, where the operator looks.
      return fail(model_failure(e));
    } catch (const std::bad_alloc&) {
      return fail(ApiError(503, "out of memory", "server_error"));
    }
  }

  json models_json() const {
    return {{"object", "list"},
            {"data", json::array({{{"id", m.id}, {"object", "model"}, {"created", 0}, {"owned_by", "flashmoe"}}})}};
  }

  std::string metrics_text() const {
    Metrics::Gauges g;
    slots.state_bytes(&g.kv_bytes_active, &g.state_bytes_active);
    g.snapshot_bytes = int64_t(cache.bytes());
    g.snapshots = int64_t(cache.size());
    g.slots_busy = slots.busy();
    g.slots_total = slots.slots();
    g.queue_waiting = slots.waiting();
    const BatchScheduler::Counters bc = scheduler.counters();
    g.batch_attached = bc.attached;
    g.batch_last_sequences = bc.attached ? bc.last_sequences : 0;
    g.batch_last_tokens = bc.attached ? bc.last_tokens : 0;
    g.batch_steps = bc.steps;
    g.batch_step_sequences = bc.step_sequences;
    g.batch_step_tokens = bc.step_tokens;
    // A model built on the GPU (serve --synthetic) has no expert store: its
    // expert counters stay 0 (/metrics answered 500 there).
    if (m.backend->has_host_model()) {
      ExpertStats es = m.backend->model().expert_store().stats();
      g.expert_requested = es.requested;
      g.expert_hits = es.hits;
      g.expert_misses = es.misses;
      g.expert_bytes_read = es.bytes_read;
    }
    return metrics.render(g);
  }

  // The caller's API key as a state-cache partition ("" without keys), or
  // nullopt when a key is required and missing or wrong. The key comes as
  // "Authorization: Bearer KEY" (OpenAI) or "x-api-key: KEY" (Anthropic).
  std::optional<std::string> key_partition(const HttpRequest& req) const {
    if (cfg.api_keys.empty()) return std::string();
    std::string key;
    std::string auth = req.header("Authorization");
    const std::string bearer = "Bearer ";
    if (auth.size() > bearer.size() && auth.compare(0, bearer.size(), bearer) == 0) key = auth.substr(bearer.size());
    else key = req.header("x-api-key");
    if (key.empty()) return std::nullopt;
    // Every key is compared (no early exit), so timing does not tell which
    // prefix matched.
    int found = -1;
    for (size_t i = 0; i < cfg.api_keys.size(); ++i)
      if (same_secret(key, cfg.api_keys[i]) && found < 0) found = int(i);
    if (found < 0) return std::nullopt;
    return "key" + std::to_string(found) + "/";
  }

  HttpResponse health() const {
    HttpResponse res;
    if (stopping) {
      res = json_response(json{{"status", "shutting down"}});
      res.status = 503;
    } else if (model_failing) {
      res = json_response(json{{"status", "error"},
                               {"error", "the model failed on the last request that reached it (the server's log "
                                         "has the reason)"}});
      res.status = 503;
    } else {
      res = json_response(json{{"status", "ok"}});
    }
    return res;
  }

  // POST /tokenize {"content", "add_special", "with_pieces"} and POST
  // /detokenize {"tokens"}, as llama.cpp's server has them.
  HttpResponse tokenize(const HttpRequest& req) const {
    json o = json::parse(req.body, nullptr, false);
    if (!o.is_object()) throw ApiError(400, "the request body must be a JSON object");
    auto c = o.find("content");
    if (c == o.end() || !c->is_string()) throw ApiError(400, "'content' must be a string", "invalid_request_error", "", "content");
    bool with_pieces = false;
    for (const char* f : {"add_special", "with_pieces", "parse_special"}) {
      auto v = o.find(f);
      if (v != o.end() && !v->is_boolean())
        throw ApiError(400, std::string("'") + f + "' must be a boolean", "invalid_request_error", "", f);
    }
    if (o.contains("with_pieces")) with_pieces = o["with_pieces"].get<bool>();
    bool parse_special = o.value("parse_special", true);
    std::vector<int32_t> ids;
    try {
      ids = m.tokenizer->encode(c->get<std::string>(), !parse_special);
    } catch (const Error&) {
      throw ApiError(400, "'content' could not be tokenized (is it valid UTF-8?)", "invalid_request_error", "", "content");
    }
    // Qwen's tokenizers add no BOS/EOS; add_special is accepted for
    // llama.cpp clients and adds nothing.
    json tokens = json::array();
    for (int32_t id : ids) {
      if (with_pieces) tokens.push_back({{"id", id}, {"piece", m.tokenizer->token_to_piece(id)}});
      else tokens.push_back(id);
    }
    return json_response(json{{"tokens", tokens}});
  }

  HttpResponse detokenize(const HttpRequest& req) const {
    json o = json::parse(req.body, nullptr, false);
    if (!o.is_object()) throw ApiError(400, "the request body must be a JSON object");
    auto t = o.find("tokens");
    if (t == o.end() || !t->is_array()) throw ApiError(400, "'tokens' must be an array of token ids", "invalid_request_error", "", "tokens");
    std::vector<int32_t> ids;
    const int64_t vocab = int64_t(m.tokenizer->vocab_size());
    for (const auto& v : *t) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab)
        throw ApiError(400, "'tokens' must hold token ids between 0 and " + std::to_string(vocab - 1),
                       "invalid_request_error", "", "tokens");
      ids.push_back(int32_t(v.get<int64_t>()));
    }
    return json_response(json{{"content", m.tokenizer->decode(ids)}});
  }

  HttpResponse route(const HttpRequest& req) {
    if (auto why = refuse_host_or_origin(req, origins)) return error_of(ApiError(403, *why, "permission_error"));
    std::string cors = cors_allow_origin(req, origins);
    HttpResponse res = route_allowed(req);
    if (!cors.empty()) {
      res.headers.emplace_back("Access-Control-Allow-Origin", cors);
      res.headers.emplace_back("Vary", "Origin");
    }
    return res;
  }

  HttpResponse route_allowed(const HttpRequest& req) {
    const std::string& p = req.path;
    if (req.method == "OPTIONS") {  // a CORS preflight (its Origin passed the check above)
      HttpResponse res;
      res.status = 204;
      res.content_type = "text/plain";
      res.headers = {{"Access-Control-Allow-Methods", "GET, POST, OPTIONS"},
                     {"Access-Control-Allow-Headers", "Authorization, Content-Type, x-api-key, anthropic-version"},
                     {"Access-Control-Max-Age", "600"}};
      return res;
    }
    if (p == "/health") {
      if (req.method != "GET" && req.method != "HEAD") return error_of(ApiError(405, "method not allowed"));
      return health();
    }
    std::optional<std::string> key = key_partition(req);
    if (!key) {
      ApiError e(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                 "authentication_error", "invalid_api_key");
      return p == "/v1/messages" ? anthropic_error_of(e) : error_of(e);
    }
    const bool get = req.method == "GET" || req.method == "HEAD", post = req.method == "POST";
    try {
      if (p == "/v1/chat/completions" || p == "/v1/completions") {
        if (!post) return error_of(ApiError(405, "method not allowed"));
        return handle_generation(req, p == "/v1/chat/completions" ? Api::Chat : Api::Completions, *key);
      }
      if (p == "/v1/messages") {
        if (!post) return anthropic_error_of(ApiError(405, "method not allowed"));
        return handle_generation(req, Api::Anthropic, *key);
      }
      if (p == "/v1/messages/count_tokens") {
        if (!post) return anthropic_error_of(ApiError(405, "method not allowed"));
        return count_tokens(req);
      }
      if (p == "/tokenize" || p == "/detokenize") {
        if (!post) return error_of(ApiError(405, "method not allowed"));
        return p == "/tokenize" ? tokenize(req) : detokenize(req);
      }
      if (p == "/v1/models" || p.rfind("/v1/models/", 0) == 0 || p == "/metrics") {
        if (!get) return error_of(ApiError(405, "method not allowed"));
        if (p == "/v1/models") return json_response(models_json());
        if (p == "/metrics") {
          HttpResponse res;
          res.content_type = "text/plain; version=0.0.4";
          res.body = metrics_text();
          return res;
        }
        std::string id = p.substr(std::string("/v1/models/").size());
        if (id != m.id)
          return error_of(ApiError(404, "the model '" + id + "' does not exist", "invalid_request_error",
                                   "model_not_found", "model"));
        return json_response(models_json()["data"][0]);
      }
    } catch (const ApiError& e) {
      return error_of(e);
    }
    return error_of(ApiError(404, "not found"));
  }
};


ApiRoutes::ApiRoutes(const ServerConfig& cfg, const ServedModel& model)
    : impl_(std::make_unique<Impl>(cfg, model)) {}

ApiRoutes::~ApiRoutes() = default;

HttpResponse ApiRoutes::handle(const HttpRequest& req) {
  try {
    return impl_->route(req);
  } catch (const std::bad_alloc&) {
    return error_of(ApiError(503, "out of memory", "server_error"));
  } catch (const std::exception& e) {
    log_failure(e);
    return error_of(ApiError(500, "internal error", "server_error"));
  }
}

bool ApiRoutes::answers_at_once(const HttpRequest& req) const {
  const std::string& p = req.path;
  return req.method == "OPTIONS" || p == "/health" || p == "/metrics" || p == "/v1/models" ||
         p.rfind("/v1/models/", 0) == 0;
}

HttpResponse ApiRoutes::error_response(int status, const std::string& message) {
  return error_of(ApiError(status, message, status >= 500 ? "server_error" : "invalid_request_error"));
}

void ApiRoutes::record(const std::string& method, const std::string& path, int status) {
  impl_->metrics.count_request(endpoint_label(path), status);
  if (impl_->cfg.access_log) {
    std::fprintf(stderr, "%s %s %d\n", method.c_str(), endpoint_label(path).c_str(), status);
    std::fflush(stderr);
  }
}

void ApiRoutes::stop() {
  impl_->stopping = true;
  impl_->slots.shutdown();
}

bool ApiRoutes::stopping() const { return impl_->stopping; }

}  // namespace flashmoe::server
