// One conversation with a loaded model: the backend's state plus the tokens
// fed so far. Prefill and decode steps continue the same state.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/argmax.h"
#include "core/thread_pool.h"
#include "engine/batch_scheduler.h"
#include "runtime/backend.h"

namespace flashmoe {

// A conversation's state copied out of its backend, with the exact tokens
// it has consumed (the server's conversation snapshots).
struct SessionSnapshot {
  std::vector<int32_t> tokens;
  std::shared_ptr<const StateSnapshot> state;
  size_t bytes() const { return state->bytes() + tokens.size() * sizeof(int32_t); }
};

class Session {
 public:
  // Sessions of one backend may run on several threads at once (a backend
  // that runs one call at a time serialises them itself).
  // drafting: the state also keeps the MTP head in step (draft(), --mtp);
  // Error when the model has none or the backend cannot draft.
  Session(const Backend& backend, const KvConfig& kv, ThreadPool& pool, bool drafting = false);
  // A session whose forward passes run as steps of `scheduler` (the
  // server's continuous batching), shared with the other sessions attached
  // to it; attached for the session's life.
  Session(BatchScheduler& scheduler, const KvConfig& kv, bool drafting = false);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Feeds tokens; returns the next-token logits after the last one.
  const std::vector<float>& feed(const std::vector<int32_t>& ids);
  // Feeds tokens and returns the logits after every one of them ([n, vocab]).
  std::vector<float> feed_all(const std::vector<int32_t>& ids);
  // Feeds tokens and returns the argmax of the logits after the last one
  // (ties: the lower id), picked on a GPU without copying the logits
  // (BatchItem::argmax): greedy decoding's feed. The logits are not kept
  // (greedy() then needs a feed() first).
  int32_t feed_argmax(const std::vector<int32_t>& ids);
  // Feeds tokens and returns the argmax after every one of them (a greedy
  // verify pass: Backend::forward_argmax_rows). The logits are not kept.
  std::vector<int32_t> feed_argmax_rows(const std::vector<int32_t>& ids);

  // Greedy continuation: the argmax after the tokens fed so far, then n-1
  // more, each fed in turn (the last one is not fed). On a GPU without host
  // round trips. Needs at least one token fed before.
  std::vector<int32_t> greedy(int64_t n);

  // A drafting session: n tokens the MTP head proposes after `next` (the
  // token chosen from the last logits, not fed), each chosen by `pick`
  // (empty: the argmax, on a GPU picked on the device). Changes nothing.
  std::vector<int32_t> draft(int32_t next, int64_t n, const DraftPicker& pick);
  bool drafting() const { return drafting_; }

  // A scheduled session's feeds ask `cancel` before each step they still
  // have tokens in (BatchScheduler::forward): true ends the feed with
  // ForwardCancelled (the session then starts over, as after any failed
  // feed). Empty: never.
  void set_cancel(std::function<bool()> cancel) { cancel_ = std::move(cancel); }

  // A scheduled session stops taking part in the steps (a finished
  // generation whose state is still to be copied out): the steps no longer
  // wait for its next tokens. Feeding it afterwards is an Error.
  void leave_batch() { membership_.reset(); }

  // Every token fed so far, unless recording is off (then empty).
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Off: fed tokens are not recorded, so a long generation holds no memory
  // per token beyond what the KV cache keeps. Only for a session that is
  // never snapshotted and whose sampling reads no history (no penalties),
  // like `flashmoe run`'s.
  void set_record_tokens(bool on) { record_tokens_ = on; }
  int64_t position() const { return state_->position(); }
  const State& state() const { return *state_; }
  State& state() { return *state_; }
  const Backend& backend() const { return backend_; }
  const KvConfig& kv_config() const { return kv_; }
  // Starts over: an empty state, no tokens. Also done by feed()/feed_all()
  // when the forward pass throws, since a half-run pass leaves the state
  // inconsistent with tokens().
  void reset();
  // The state and tokens copied out, and replaced by such a copy (taken
  // from a session of the same backend and KV config).
  SessionSnapshot snapshot() const;
  void restore(const SessionSnapshot& snap);
  // A restore point for this session only (State::rollback_point: on a GPU
  // kept on the device), given to restore(); valid until the next one.
  SessionSnapshot rollback_point();
  // The tokens fed after `position` taken back without a restore point,
  // where the state kept what that needs (State::take_back): true.
  bool take_back(int64_t position);

 private:
  void run_forward(const std::vector<int32_t>& ids, LogitsMode mode, float* out, int32_t* argmax = nullptr);

  const Backend& backend_;
  KvConfig kv_;
  ThreadPool* pool_ = nullptr;            // without a scheduler
  BatchScheduler* scheduler_ = nullptr;   // with one
  std::unique_ptr<ThreadPool> draft_pool_;  // a scheduled drafting session's
  std::optional<BatchScheduler::Membership> membership_;
  std::unique_ptr<State> state_;
  std::vector<int32_t> tokens_;
  bool record_tokens_ = true;
  bool drafting_ = false;
  std::vector<float> logits_;
  std::function<bool()> cancel_;
};

}  // namespace flashmoe
