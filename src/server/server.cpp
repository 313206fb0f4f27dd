#include "server/server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>

#include "core/error.h"
#include "engine/generator.h"
#include "engine/json_schema_grammar.h"
#include "engine/session.h"
#include "engine/token_constraint.h"
#include "kv/memory_calc.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/slots.h"
#include "server/state_cache.h"

namespace flashmoe::server {

using json = nlohmann::ordered_json;

namespace {

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string random_id(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s%016llx", prefix, (unsigned long long)rng());
  return buf;
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

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e), "application/json");
}

// Metrics label: the known routes by name, everything else as "other".
std::string endpoint_label(const std::string& path) {
  for (const char* p : {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})
    if (path == p) return p;
  return "other";
}

std::string sse(const json& j) { return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n"; }

}  // namespace

// One prepared completion: validated, templated and tokenized, ready to run.
struct Job {
  CompletionRequest req;
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
};

struct HttpServer::Impl {
  ServerConfig cfg;
  ServedModel m;
  httplib::Server svr;
  SlotPool slots;
  StateCache cache;
  Metrics metrics;
  std::atomic<bool> stopping{false};
  std::once_flag vocab_once;  // the constraint vocabulary (tries), built for the first response_format
  std::shared_ptr<const TokenVocabulary> vocab;

  Impl(ServerConfig c, ServedModel model)
      : cfg(std::move(c)), m(std::move(model)), slots(cfg.parallel, cfg.queue, cfg.threads_per_slot),
        cache(cfg.state_cache, cfg.state_cache_bytes) {}

  // The state bytes of a running request, for the gauges.
  void report(SlotPool::Lease& lease, const Session& s) const {
    const StateBytes b = s.state().bytes();
    lease.report(b.kv, b.recurrent);
  }

  // ---- request -> job ----

  Job prepare(const std::string& body, bool chat) {
    Job j;
    j.req = parse_completion_request(body, chat);
    const CompletionRequest& q = j.req;
    if (!q.model.empty() && q.model != m.id)
      throw ApiError(400, "the model '" + q.model + "' does not exist; this server serves '" + m.id + "'",
                     "invalid_request_error", "model_not_found", "model");
    std::string text, head;
    if (chat) {
      if (!m.chat) throw ApiError(400, "this model has no chat template; use /v1/completions");
      try {
        text = m.chat->render(q.messages, true);
        head = m.chat->render(q.messages, false);
      } catch (const Error&) {
        throw ApiError(400, "the chat template could not be applied to these messages", "invalid_request_error",
                       "", "messages");
      }
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
    p.presence_penalty = q.presence_penalty;
    p.frequency_penalty = q.frequency_penalty;
    p.seed = q.seed ? *q.seed : std::random_device{}();
    p.eos_ids = q.ignore_eos ? std::vector<int32_t>{} : (chat ? m.eos_chat : m.eos_text);
    j.go.sampling = p;
    j.go.max_new_tokens = int(std::min<int64_t>(q.max_tokens.value_or(cfg.max_tokens), cfg.max_tokens));
    j.go.stop = q.stop;
    j.go.context_limit = m.context;
    j.go.cancel = &stopping;
    if (!q.response_format.is_null()) {
      std::call_once(vocab_once, [&] { vocab = std::make_shared<const TokenVocabulary>(*m.tokenizer); });
      try {
        j.constraint = make_json_constraint(q.response_format, vocab);
      } catch (const JsonSchemaError& e) {
        throw ApiError(400, e.what(), "invalid_request_error", "", "response_format");
      }
      j.go.constraint = j.constraint.get();
    }
    j.id = random_id(chat ? "chatcmpl-" : "cmpl-");
    j.created = unix_time();
    return j;
  }

  // ---- running a job on a slot ----

  // Starts from the longest stored snapshot the prompt extends, feeds up to
  // the last complete message (and stores that point), then generates; the
  // finished conversation (prompt + answer) is stored too.
  Outcome run(Job& j, SlotPool::Lease& lease, const std::function<bool(const std::string&)>& on_text) {
    Outcome out;
    // A backend that runs one call at a time takes the slots' calls in turn
    // (a prompt, then each decoded token) in request order: --parallel N
    // still lets a short request be answered while a long one streams.
    Session s(*m.backend, m.kv, lease.threads());
    auto store = [&] {
      // No copy that the cache would not keep (--state-cache 0, over the budget).
      const StateBytes b = s.state().bytes();
      if (!cache.would_keep(size_t(b.kv + b.recurrent) + s.tokens().size() * sizeof(int32_t))) return;
      cache.put(s.snapshot());
    };
    size_t fed = 0;
    if (auto snap = cache.find(j.ids)) {
      s.restore(*snap);
      fed = snap->tokens.size();
      out.reused = int64_t(fed);
    }
    double head_seconds = 0;
    if (j.boundary > fed) {  // split there even without a cache, so results do not depend on it
      auto t0 = std::chrono::steady_clock::now();
      s.feed(std::vector<int32_t>(j.ids.begin() + std::ptrdiff_t(fed), j.ids.begin() + std::ptrdiff_t(j.boundary)));
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
    out.r = generate(s, *m.tokenizer, std::vector<int32_t>(j.ids.begin() + std::ptrdiff_t(fed), j.ids.end()), j.go, cb);
    out.r.prompt_seconds += head_seconds;
    out.r.prompt_tokens = int64_t(j.ids.size());
    bool cancelled = out.r.finish_reason == "cancelled";
    if (!cancelled) store();
    metrics.count_generation(int64_t(j.ids.size()), out.reused, int64_t(out.r.ids.size()), out.r.prompt_seconds,
                             out.r.gen_seconds, cancelled);
    return out;
  }

  // ---- responses ----

  json usage(const Job& j, const Outcome& o) const {
    int64_t n = int64_t(o.r.ids.size());
    return {{"prompt_tokens", int64_t(j.ids.size())},
            {"completion_tokens", n},
            {"total_tokens", int64_t(j.ids.size()) + n},
            {"prompt_tokens_details", {{"cached_tokens", o.reused}}}};
  }

  static std::string finish_reason(const Outcome& o) { return o.r.finish_reason == "length" ? "length" : "stop"; }

  json full_response(const Job& j, const Outcome& o) const {
    json choice;
    if (j.req.chat)
      choice = {{"index", 0},
                {"message", {{"role", "assistant"}, {"content", o.r.text}}},
                {"logprobs", nullptr},
                {"finish_reason", finish_reason(o)}};
    else
      choice = {{"index", 0}, {"text", o.r.text}, {"logprobs", nullptr}, {"finish_reason", finish_reason(o)}};
    return {{"id", j.id},
            {"object", j.req.chat ? "chat.completion" : "text_completion"},
            {"created", j.created},
            {"model", m.id},
            {"choices", json::array({choice})},
            {"usage", usage(j, o)}};
  }

  json chunk(const Job& j, json delta_or_text, const json& finish) const {
    json choice = {{"index", 0}};
    if (j.req.chat) choice["delta"] = std::move(delta_or_text);
    else choice["text"] = std::move(delta_or_text);
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = finish;
    return {{"id", j.id},
            {"object", j.req.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", j.created},
            {"model", m.id},
            {"choices", json::array({choice})}};
  }

  void handle_completion(const httplib::Request& req, httplib::Response& res, bool chat) {
    try {
      auto job = std::make_shared<Job>(prepare(req.body, chat));
      std::shared_ptr<SlotPool::Lease> lease = slots.acquire();
      if (!lease) {
        if (stopping) throw ApiError(503, "the server is shutting down", "server_error");
        throw ApiError(503, "the server is busy (all slots and the queue are full); retry later", "server_error");
      }
      if (!job->req.stream) {
        Outcome o = run(*job, *lease, [](const std::string&) { return true; });
        res.set_content(full_response(*job, o).dump(-1, ' ', false, json::error_handler_t::replace),
                        "application/json");
        return;
      }
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      res.set_chunked_content_provider(
          "text/event-stream", [this, job, lease](size_t, httplib::DataSink& sink) mutable {
            auto write = [&](const std::string& s) { return sink.is_writable() && sink.write(s.data(), s.size()); };
            try {
              if (!lease) return false;  // a second call: the stream already ended
              bool ok = write(sse(chunk(*job, job->req.chat ? json{{"role", "assistant"}, {"content", ""}} : json(""),
                                        nullptr)));
              Outcome o;
              if (ok) {
                o = run(*job, *lease, [&](const std::string& piece) {
                  return write(sse(chunk(*job, job->req.chat ? json{{"content", piece}} : json(piece), nullptr)));
                });
              } else {
                metrics.count_generation(0, 0, 0, 0, 0, true);
              }
              lease.reset();  // free the slot before the last writes
              if (!ok || o.r.finish_reason == "cancelled") return false;
              write(sse(chunk(*job, job->req.chat ? json::object() : json(""), finish_reason(o))));
              if (job->req.include_usage) {
                json u = chunk(*job, json::object(), nullptr);
                u["choices"] = json::array();
                u["usage"] = usage(*job, o);
                write(sse(u));
              }
              write("data: [DONE]\n\n");
              sink.done();
              return true;
            } catch (const std::exception& e) {
              lease.reset();
              log_failure(e);
              write(sse(json{{"error", {{"message", model_failure_message(e)}, {"type", "server_error"}}}}));
              return false;
            }
          });
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const Error& e) {
      // Requests are validated before they run (ApiError above), so an Error
      // here is the model failing: a corrupt or vanished expert file, the
      // GPU. The server's fault, not the client's: 5xx, and the reason goes
      // to the server's log, where the operator looks.
      log_failure(e);
      send_error(res, ApiError(out_of_device_memory(e) ? 503 : 500, model_failure_message(e), "server_error"));
    } catch (const std::bad_alloc&) {
      send_error(res, ApiError(503, "out of memory", "server_error"));
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
    ExpertStats es = m.backend->model().expert_store().stats();
    g.expert_requested = es.requested;
    g.expert_hits = es.hits;
    g.expert_misses = es.misses;
    g.expert_bytes_read = es.bytes_read;
    return metrics.render(g);
  }

  void setup() {
    int threads = cfg.parallel + cfg.queue + 8;  // generating + waiting + cheap endpoints
    svr.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    svr.set_payload_max_length(cfg.max_body);
    svr.set_keep_alive_timeout(2);
    svr.set_read_timeout(30);
    svr.set_write_timeout(30);

    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (cfg.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
      std::string auth = req.get_header_value("Authorization");
      const std::string bearer = "Bearer ";
      if (auth.size() > bearer.size() && auth.compare(0, bearer.size(), bearer) == 0 &&
          same_secret(auth.substr(bearer.size()), cfg.api_key))
        return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                               "authentication_error", "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    });
    svr.Post("/v1/chat/completions",
             [this](const httplib::Request& req, httplib::Response& res) { handle_completion(req, res, true); });
    svr.Post("/v1/completions",
             [this](const httplib::Request& req, httplib::Response& res) { handle_completion(req, res, false); });
    svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(models_json().dump(), "application/json");
    });
    svr.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      if (req.matches[1] != m.id) {
        send_error(res, ApiError(404, "the model '" + std::string(req.matches[1]) + "' does not exist",
                                 "invalid_request_error", "model_not_found", "model"));
        return;
      }
      res.set_content(models_json()["data"][0].dump(), "application/json");
    });
    svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      if (stopping) res.status = 503;
      res.set_content(json{{"status", stopping ? "shutting down" : "ok"}}.dump(), "application/json");
    });
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
    // Statuses httplib sets by itself (404, 413, 400 for a bad request line)
    // get the same JSON error shape as ours.
    svr.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request&, httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string msg = "bad request";
      if (res.status == 404) msg = "not found";
      else if (res.status == 405) msg = "method not allowed";
      else if (res.status == 413) msg = "the request body is larger than this server's limit of " + std::to_string(cfg.max_body) + " bytes";
      else if (res.status >= 500) msg = "internal error";
      send_error(res, ApiError(res.status, msg, res.status >= 500 ? "server_error" : "invalid_request_error"));
      return httplib::Server::HandlerResponse::Handled;
    }));
    svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
      send_error(res, ApiError(500, "internal error", "server_error"));
    });
    svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      metrics.count_request(endpoint_label(req.path), res.status);
      if (cfg.access_log)
        std::fprintf(stderr, "%s %s %d\n", req.method.c_str(), endpoint_label(req.path).c_str(), res.status);
    });
  }
};

HttpServer::HttpServer(ServerConfig cfg, ServedModel model) : impl_(std::make_unique<Impl>(std::move(cfg), std::move(model))) {
  impl_->setup();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  auto& c = impl_->cfg;
  int port = c.port;
  if (port == 0) port = impl_->svr.bind_to_any_port(c.host);
  else if (!impl_->svr.bind_to_port(c.host, port)) port = -1;
  if (port <= 0) fail("cannot listen on " + c.host + ":" + std::to_string(c.port) + " (address in use or not available)");
  return port;
}

bool HttpServer::listen() { return impl_->svr.listen_after_bind(); }

void HttpServer::stop() {
  impl_->stopping = true;
  impl_->slots.shutdown();
  impl_->svr.stop();
}

}  // namespace flashmoe::server
