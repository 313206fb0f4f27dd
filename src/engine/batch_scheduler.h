// Continuous batching: one thread owns the model's forward passes and runs
// them as shared steps. Every session attached to the scheduler hands it
// its tokens (a prompt, or the one token it just sampled) and waits; each
// step gathers the next token of every decoding session plus chunks of
// waiting prompts within a per-step token budget, runs one
// Backend::forward_batch over all of them (each on its own state), and
// wakes each session with its logits. Sampling, stop strings, constraints
// and streaming stay on the sessions' own threads (engine/generator.h), so
// every request keeps its own parameters; sessions join and leave between
// steps.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "runtime/backend.h"

namespace flashmoe {

// What BatchScheduler::forward throws when its request was cancelled
// (cancel() said so at a step's start): the tokens not yet through were
// dropped, so the state is part-way through them (Session resets it).
class ForwardCancelled : public Error {
 public:
  ForwardCancelled() : Error("the request was cancelled") {}
};

struct BatchSchedulerOptions {
  // Tokens per step: every decoding session's token, then prompt chunks up
  // to this total (at least kMinPromptChunk prompt tokens when decodes
  // alone reach it), so a long prompt never stalls the others' decoding for
  // more than one step's worth of prompt.
  int64_t step_tokens = 512;
  // How long a step waits, after the previous one, for attached sessions
  // that have not handed in their next token yet (sampling, writing to a
  // client): this, or half the previous step's time if longer (a straggler
  // then costs at most half a step, while a step run without it would cost
  // a whole one for fewer tokens). Those that miss it join the next step.
  std::chrono::microseconds gather{3000};
};

// What one step held (for /metrics and tests).
struct BatchStepInfo {
  int64_t sequences = 0, tokens = 0, prompt_tokens = 0;
  std::vector<const State*> states;  // the states fed, in batch order
};

class BatchScheduler {
 public:
  static constexpr int64_t kMinPromptChunk = 16;
  // The most tokens of a lone session's call that run on the session's own
  // thread: a decoded token, or one with up to 16 drafts (--spec-draft's
  // limit). A longer call (a prompt) runs on the scheduler's thread even
  // when alone: the CPU forward keeps its scratch per calling thread, sized
  // by the largest step that thread ran, and the server's request threads
  // are many (--parallel + --queue + 4), so prompts run on them left every
  // one holding a prompt chunk's buffers (bench/NOTES.md, "Session 27").
  static constexpr int64_t kLoneStepTokens = 1 + 16;

  BatchScheduler(const Backend& backend, ThreadPool& pool, BatchSchedulerOptions opt = {});
  ~BatchScheduler();  // finishes the step in flight; later calls throw
  BatchScheduler(const BatchScheduler&) = delete;
  BatchScheduler& operator=(const BatchScheduler&) = delete;

  // A session's membership: while attached, a step waits (up to `gather`)
  // for its next tokens. RAII: attach() for the session's life.
  class Membership {
   public:
    explicit Membership(BatchScheduler& s);
    ~Membership();
    Membership(const Membership&) = delete;
    Membership& operator=(const Membership&) = delete;

   private:
    BatchScheduler& s_;
  };

  // Backend::forward through the steps: blocks until all n tokens went
  // through (a prompt may take several steps); rethrows what its step
  // threw (ids outside the vocabulary: Error before any state is touched).
  // argmax (mode Last): receives the argmax of the last logits, which a GPU
  // picks on the device (BatchItem::argmax); logits may then be null.
  // cancel (may be empty): asked, on the scheduler's thread, before each
  // step while tokens of this call are still waiting; true ends the call
  // with ForwardCancelled, so a long prompt whose client has gone (or a
  // server shutting down) frees its place within one step instead of
  // running its whole prefill. Must stay valid during the call.
  void forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits, int32_t* argmax = nullptr,
               const std::function<bool()>* cancel = nullptr);

  const Backend& backend() const { return backend_; }

  struct Counters {
    int64_t attached = 0;  // sessions attached now
    int64_t steps = 0, step_sequences = 0, step_tokens = 0;  // totals since start
    int64_t last_sequences = 0, last_tokens = 0;             // the latest step
  };
  Counters counters() const;
  // Called on the scheduler's thread after every step (tests).
  void set_step_observer(std::function<void(const BatchStepInfo&)> f);

 private:
  // One caller's wake-up: a flag under its own mutex and condition
  // variable. std::binary_semaphore's acquire (libstdc++) spins through a
  // dozen sched_yield calls before it sleeps: with 8 sessions on a 2-core
  // machine those were a third of the sessions' CPU time, taken from the
  // step (bench/NOTES.md, "Session 23"). This one sleeps at once.
  class Wake {
   public:
    // Sets the flag and wakes the waiter, under the mutex: the waiter cannot
    // return (and free the request) before this call is done with it.
    void release() {
      std::lock_guard<std::mutex> lock(m_);
      set_ = true;
      cv_.notify_one();
    }
    void acquire() {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [this] { return set_; });
      set_ = false;
    }

   private:
    std::mutex m_;
    std::condition_variable cv_;
    bool set_ = false;
  };
  struct Request {
    State* state;
    const int32_t* ids;
    int64_t n, done = 0;
    LogitsMode mode;
    float* logits;
    int32_t* argmax;
    const std::function<bool()>* cancel;
    int64_t vocab;
    bool finished = false;  // under mu_: the loop is done with it
    std::exception_ptr error;
    // Released once finished, after mu_ is let go: each caller wakes on its
    // own, in parallel, instead of every caller of a step queueing for mu_
    // behind one notify_all (~32 hand-offs in series between two steps).
    Wake wake;
  };
  void loop();
  // finish (under mu_): r is done with `error` (or none), and joins rs;
  // wake_all (after mu_ is let go): rs's callers return, rs is emptied.
  static void finish(std::vector<Request*>& rs, Request* r, std::exception_ptr error);
  static void wake_all(std::vector<Request*>& rs);

  const Backend& backend_;
  ThreadPool& pool_;
  BatchSchedulerOptions opt_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<Request*> pending_;  // arrival order
  int64_t attached_ = 0;
  bool stopping_ = false;
  bool lone_step_ = false;  // a lone session runs a step on its own thread
  Counters counters_;
  std::function<void(const BatchStepInfo&)> observer_;
  std::thread thread_;
};

}  // namespace flashmoe
