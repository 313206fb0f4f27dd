#include "engine/batch_scheduler.h"

#include <algorithm>

#include "core/error.h"
#include "model/plan.h"

namespace flashmoe {

BatchScheduler::BatchScheduler(const Backend& backend, ThreadPool& pool, BatchSchedulerOptions opt)
    : backend_(backend), pool_(pool), opt_(opt) {
  opt_.step_tokens = std::max<int64_t>(opt_.step_tokens, 1);
  thread_ = std::thread([this] { loop(); });
}

BatchScheduler::~BatchScheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

BatchScheduler::Membership::Membership(BatchScheduler& s) : s_(s) {
  std::lock_guard<std::mutex> lock(s_.mu_);
  ++s_.attached_;
  s_.counters_.attached = s_.attached_;
}

BatchScheduler::Membership::~Membership() {
  {
    std::lock_guard<std::mutex> lock(s_.mu_);
    --s_.attached_;
    s_.counters_.attached = s_.attached_;
  }
  s_.work_cv_.notify_all();  // a step may be waiting for this session
}

void BatchScheduler::forward(State& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                             int32_t* argmax, const std::function<bool()>* cancel) {
  // Checked here, on the caller's thread: a bad id fails its own request,
  // never the step it would have shared with others.
  check_token_ids(backend_.config(), ids, n);
  if (argmax && mode != LogitsMode::Last) fail("an argmax needs LogitsMode::Last");
  if (n <= 0) return;
  if (cancel && !*cancel) cancel = nullptr;
  if (cancel && (*cancel)()) throw ForwardCancelled();
  Request r{&st, ids, n, 0, mode, logits, argmax, cancel, backend_.config().vocab_size, false, nullptr, {}};
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) fail("the batch scheduler has stopped");
  // A lone session's decoded token (or speculative round) runs its step on
  // its own thread: the same call the loop would make, without handing each
  // token to the scheduler's thread and back (two wake-ups per token, ~10%
  // of a small model's decode). Nobody else is waiting, and the loop starts
  // no step while this one runs. Prompts go to the loop (kLoneStepTokens).
  if (attached_ <= 1 && pending_.empty() && !lone_step_ && n <= std::min(kLoneStepTokens, opt_.step_tokens)) {
    lone_step_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      if (argmax) {
        const BatchItem it{&st, ids, n, mode, logits, argmax};
        backend_.forward_batch(&it, 1, pool_);
      } else {
        backend_.forward(st, ids, n, mode, logits, pool_);
      }
    } catch (...) {
      error = std::current_exception();
    }
    BatchStepInfo info;
    info.sequences = 1;
    info.tokens = n;
    info.prompt_tokens = n > 1 ? n : 0;
    info.states.push_back(&st);
    lock.lock();
    auto observer = observer_;
    lone_step_ = false;
    ++counters_.steps;
    counters_.step_sequences += 1;
    counters_.step_tokens += n;
    counters_.last_sequences = 1;
    counters_.last_tokens = n;
    lock.unlock();
    work_cv_.notify_all();
    if (observer) observer(info);
    if (error) std::rethrow_exception(error);
    return;
  }
  pending_.push_back(&r);
  // The loop waits for a first request, then for every attached session's:
  // only those two wake it (one wake-up per session handing in was a
  // context switch each on a machine of few cores, in series with the step).
  if (pending_.size() == 1 || int64_t(pending_.size()) >= attached_) work_cv_.notify_all();
  lock.unlock();
  r.wake.acquire();  // the loop touches r no more (release happens-before this)
  if (r.error) std::rethrow_exception(r.error);
}

void BatchScheduler::finish(std::vector<Request*>& rs, Request* r, std::exception_ptr error) {
  r->error = std::move(error);
  r->finished = true;
  rs.push_back(r);
}

void BatchScheduler::wake_all(std::vector<Request*>& rs) {
  for (Request* r : rs) r->wake.release();  // r may be gone right after this
  rs.clear();
}

BatchScheduler::Counters BatchScheduler::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void BatchScheduler::set_step_observer(std::function<void(const BatchStepInfo&)> f) {
  std::lock_guard<std::mutex> lock(mu_);
  observer_ = std::move(f);
}

void BatchScheduler::loop() {
  using Clock = std::chrono::steady_clock;
  Clock::time_point last_end = Clock::now();
  Clock::duration last_step{0};
  std::vector<Request*> woken;  // finished under the lock, released after it
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || (!pending_.empty() && !lone_step_); });
    // Gather: every attached session's next tokens, or whoever is in by
    // the end of the window after the previous step.
    const Clock::duration window = std::max<Clock::duration>(opt_.gather, last_step / 2);
    work_cv_.wait_until(lock, last_end + window,
                        [&] { return stopping_ || int64_t(pending_.size()) >= attached_; });
    if (stopping_) {
      for (Request* r : pending_) finish(woken, r, std::make_exception_ptr(Error("the batch scheduler has stopped")));
      pending_.clear();
      lock.unlock();
      wake_all(woken);
      return;
    }

    // Cancelled requests leave before the step (a prompt part-way through
    // its chunks, whose client has gone): the rest of their tokens never run.
    for (Request* r : pending_)
      if (r->cancel && (*r->cancel)()) finish(woken, r, std::make_exception_ptr(ForwardCancelled()));
    if (!woken.empty()) {
      pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](Request* r) { return r->finished; }),
                     pending_.end());
      lock.unlock();
      wake_all(woken);
      lock.lock();
      if (pending_.empty()) continue;
    }

    // Decoding sessions (one token left) all go in; prompts in arrival
    // order fill the rest of the budget.
    std::vector<Request*> step;
    std::vector<int64_t> take;
    int64_t decodes = 0;
    for (Request* r : pending_)
      if (r->n - r->done == 1) {
        step.push_back(r);
        take.push_back(1);
        ++decodes;
      }
    int64_t budget = std::max(opt_.step_tokens - decodes, kMinPromptChunk);
    for (Request* r : pending_) {
      if (budget == 0) break;
      if (r->n - r->done == 1) continue;
      const int64_t t = std::min(r->n - r->done, budget);
      step.push_back(r);
      take.push_back(t);
      budget -= t;
    }
    std::vector<BatchItem> items(step.size());
    BatchStepInfo info;
    for (size_t i = 0; i < step.size(); ++i) {
      Request& r = *step[i];
      BatchItem& it = items[i];
      it.state = r.state;
      it.ids = r.ids + r.done;
      it.n = take[i];
      const bool last = r.done + take[i] == r.n;
      it.mode = r.mode == LogitsMode::All ? LogitsMode::All : (last ? r.mode : LogitsMode::None);
      it.logits = r.mode == LogitsMode::All ? r.logits + r.done * r.vocab : r.logits;
      it.argmax = last ? r.argmax : nullptr;
      info.tokens += it.n;
      info.prompt_tokens += r.n > 1 ? it.n : 0;  // a prompt's last token counts too
      info.states.push_back(r.state);
    }
    info.sequences = int64_t(items.size());
    auto observer = observer_;

    lock.unlock();
    const Clock::time_point start = Clock::now();
    std::exception_ptr error;
    try {
      backend_.forward_batch(items.data(), int64_t(items.size()), pool_);
    } catch (...) {
      error = std::current_exception();
    }
    if (observer) observer(info);
    lock.lock();
    last_end = Clock::now();
    last_step = last_end - start;

    for (size_t i = 0; i < step.size(); ++i) {
      Request& r = *step[i];
      r.done += take[i];
      if (error || r.done == r.n) finish(woken, &r, error);
    }
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](Request* r) { return r->finished; }),
                   pending_.end());
    ++counters_.steps;
    counters_.step_sequences += info.sequences;
    counters_.step_tokens += info.tokens;
    counters_.last_sequences = info.sequences;
    counters_.last_tokens = info.tokens;
    lock.unlock();
    wake_all(woken);
    lock.lock();
  }
}

}  // namespace flashmoe
