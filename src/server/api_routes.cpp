#include "server/api_routes.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>

#include "core/error.h"
#include "engine/generator.h"
#include "engine/session.h"
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
  std::string id;
  int64_t created = 0;
};

struct Outcome {
  GenerateResult r;
  int64_t reused = 0;
};

struct ApiRoutes::Impl {
  ServerConfig cfg;
  ServedModel m;
  SlotPool slots;
  StateCache cache;
  Metrics metrics;
  std::atomic<bool> stopping{false};

  Impl(const ServerConfig& c, const ServedModel& model)
      : cfg(c), m(model), slots(cfg.parallel, cfg.queue, cfg.threads_per_slot),
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

  HttpResponse handle_completion(const HttpRequest& req, bool chat) {
    try {
      auto job = std::make_shared<Job>(prepare(req.body, chat));
      std::shared_ptr<SlotPool::Lease> lease = slots.acquire();
      if (!lease) {
        if (stopping) throw ApiError(503, "the server is shutting down", "server_error");
        throw ApiError(503, "the server is busy (all slots and the queue are full); retry later", "server_error");
      }
      if (!job->req.stream) {
        Outcome o = run(*job, *lease, [](const std::string&) { return true; });
        return json_response(full_response(*job, o));
      }
      HttpResponse res;
      res.content_type = "text/event-stream";
      res.headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
      res.stream = [this, job, lease](EventSink& sink) mutable {
        auto write = [&](const std::string& s) { return sink.write(s); };
        try {
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
          if (!ok || o.r.finish_reason == "cancelled") return;
          write(sse(chunk(*job, job->req.chat ? json::object() : json(""), finish_reason(o))));
          if (job->req.include_usage) {
            json u = chunk(*job, json::object(), nullptr);
            u["choices"] = json::array();
            u["usage"] = usage(*job, o);
            write(sse(u));
          }
          write("data: [DONE]\n\n");
        } catch (const std::exception& e) {
          lease.reset();
          log_failure(e);
          write(sse(json{{"error", {{"message", model_failure_message(e)}, {"type", "server_error"}}}}));
        }
      };
      return res;
    } catch (const ApiError& e) {
      return error_of(e);
    } catch (const Error& e) {
      // Requests are validated before they run (ApiError above), so an Error
      // here is the model failing: a corrupt or vanished expert file, the
      // GPU. The server's fault, not the client's: 5xx, and the reason goes
      // to the server's log, where the operator looks.
      log_failure(e);
      return error_of(ApiError(out_of_device_memory(e) ? 503 : 500, model_failure_message(e), "server_error"));
    } catch (const std::bad_alloc&) {
      return error_of(ApiError(503, "out of memory", "server_error"));
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

  bool authorized(const HttpRequest& req) const {
    if (cfg.api_key.empty() || req.path == "/health") return true;
    std::string auth = req.header("Authorization");
    const std::string bearer = "Bearer ";
    return auth.size() > bearer.size() && auth.compare(0, bearer.size(), bearer) == 0 &&
           same_secret(auth.substr(bearer.size()), cfg.api_key);
  }

  HttpResponse route(const HttpRequest& req) {
    if (!authorized(req))
      return error_of(ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                               "authentication_error", "invalid_api_key"));
    const std::string& p = req.path;
    const bool get = req.method == "GET" || req.method == "HEAD", post = req.method == "POST";
    if (p == "/v1/chat/completions" || p == "/v1/completions") {
      if (!post) return error_of(ApiError(405, "method not allowed"));
      return handle_completion(req, p == "/v1/chat/completions");
    }
    if (p == "/v1/models" || p.rfind("/v1/models/", 0) == 0 || p == "/health" || p == "/metrics") {
      if (!get) return error_of(ApiError(405, "method not allowed"));
      if (p == "/v1/models") return json_response(models_json());
      if (p == "/health") {
        HttpResponse res = json_response(json{{"status", stopping ? "shutting down" : "ok"}});
        if (stopping) res.status = 503;
        return res;
      }
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
  return p == "/health" || p == "/metrics" || p == "/v1/models" || p.rfind("/v1/models/", 0) == 0;
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
