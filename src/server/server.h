// `flashmoe serve`: an OpenAI-compatible HTTP server over one loaded model.
// Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
// POST /tokenize, POST /detokenize, GET /health, GET /metrics. See
// docs/server.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/backend.h"
#include "engine/sampler.h"
#include "kv/kv_config.h"
#include "model/qwen_model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8080;                  // 0: any free port (see HttpServer::bind)
  // Non-empty: every endpoint but /health needs one of these keys (Bearer or
  // x-api-key); each key's requests get their own state-cache partition.
  std::vector<std::string> api_keys;
  std::vector<std::string> cors_origins;  // browser origins allowed ("*": any); empty: none
  int parallel = 1;                 // requests generating at once: the largest batch of a step
  int queue = 32;                   // requests waiting for a slot before 503
  size_t max_body = 1 << 20;        // bytes, chunked or not; larger bodies get 413
  size_t max_header_bytes = 16 << 10;  // request line + headers; larger get 431
  size_t max_header_fields = 100;   // more get 431
  int64_t read_timeout_ms = 30000;  // a whole request (headers + body) must arrive within it
  int64_t write_timeout_ms = 30000;  // a client that does not read a response for this long is dropped
  size_t state_cache = 32;          // conversation snapshots kept (0: no reuse)
  size_t state_cache_bytes = size_t(4096) << 20;  // and the memory they may hold
  int threads = 1;                  // the scheduler's threads: every step's forward pass uses them all
  int64_t batch_tokens = 512;       // tokens per step: every decoding request's token plus prompt chunks
  int64_t batch_gather_us = 3000;   // a step waits up to this (or half the last step) for late sessions
  int max_tokens = 4096;            // default for max_tokens, and the most a request may ask for
  bool access_log = false;          // one line per request on stderr
};

// The model as the server sees it; everything is borrowed and must outlive
// the server. The model and tokenizer are only read, from many threads.
struct ServedModel {
  std::string id;                   // model id in requests and /v1/models
  const Backend* backend = nullptr;  // runs the forward pass of every slot
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat = nullptr;   // null: /v1/chat/completions answers 400
  KvConfig kv;
  SamplingParams defaults;          // generation_config.json defaults (seed unused)
  std::vector<int32_t> eos_chat, eos_text;
  int64_t context = 0;              // context limit in tokens
  int spec_draft = 0;               // > 0: --mtp, drafts per pass (drafting sessions)
};

class HttpServer {
 public:
  HttpServer(ServerConfig cfg, ServedModel model);
  ~HttpServer();
  // Binds the listening socket; returns the port (useful with port 0).
  // Throws flashmoe::Error when the address cannot be bound (in use, say).
  int bind();
  // Serves until stop(); returns false if the server failed.
  bool listen();
  // From any thread (or a signal-waiting thread): stops accepting, cancels
  // running generations (streams end with an error event, other requests
  // with 503), refuses queued ones, waits for those answers to be written,
  // then makes listen() return.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashmoe::server
