// Self-speculative decoding with the model's multi-token-prediction head
// (--mtp): the head drafts N tokens, the model verifies [next, d1..dN] in one
// forward pass, and the longest acceptable prefix is kept. Acceptance is the
// standard rejection rule (Leviathan et al. 2023, Chen et al. 2023): draft d
// drawn from the head's distribution q is kept with probability
// min(1, p(d) / q(d)) under the model's distribution p, else the token is
// drawn from max(0, p - q) renormalised; when all N are kept one more is
// drawn from p. The output distribution is the model's; under greedy
// sampling p and q are one-hot, so a draft is kept exactly when it is the
// argmax and the output is the plain greedy output token for token.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "engine/session.h"

namespace flashmoe {

struct SpecStats {
  int64_t rounds = 0;                        // verify passes
  int64_t drafted = 0, accepted = 0;
  std::vector<int64_t> drafted_at, accepted_at;  // per draft position (0-based)
  int64_t emitted = 0;                       // tokens the rounds produced (accepted + one each)
  void add(const SpecStats& o);
  // "mtp: 120 drafted, 96 accepted (0.80; per position 0.90 0.80 ...), 2.6 tokens per pass"
  std::string describe() const;
};

class Speculator {
 public:
  // `session` must be a drafting session; `sampler` decides (and draws
  // the random numbers of) every choice.
  Speculator(Session& session, Sampler& sampler, SpecStats* stats = nullptr);

  // The session holds everything before `next` (chosen from its last
  // logits, not fed). Drafts n >= 1 tokens, verifies them and returns the
  // tokens after `next`: c_1..c_{a+1} (a accepted drafts, then the model's
  // own choice), with the logits each was chosen from ([a+1, vocab]).
  // Afterwards the session holds next, c_1..c_a.
  struct Round {
    std::vector<int32_t> tokens;
    std::vector<float> logits;
    int64_t accepted = 0;
  };
  Round round(int32_t next, int64_t n);
  // Tests: replaces the head's draft at absolute position `pos` (step k of
  // the round) by what this returns; the draft distribution q is then
  // one-hot on it, so the rule above still keeps the output distribution.
  using DraftOverride = std::function<int32_t(int64_t pos, int64_t step, int32_t drafted)>;
  void set_draft_override(DraftOverride f) { override_ = std::move(f); }
  // Benchmarks (bench --mtp-accept): each drafted token is kept with
  // probability `rate` (independently, from a generator seeded with
  // `seed`; the round ends at the first one not kept) instead of by the
  // rule above, and kept ones are emitted whatever the model chose. The
  // round does the work of a real one at that acceptance (n head steps, a
  // verify pass of n + 1 tokens, the roll-back of what was not kept); the
  // tokens are no longer the model's. rate < 0: the rule (the default).
  void set_forced_acceptance(double rate, uint64_t seed);
  // false: round() leaves Round::logits empty, and under plain greedy
  // sampling without a draft override the drafts and the verify pass then
  // pick their argmax on the device (Session::draft with no picker,
  // feed_argmax_rows): ids cross to the host, not rows of logits.
  void set_logits_wanted(bool on) { logits_wanted_ = on; }
  // false: keep() never takes back (State::take_back) but restores the
  // state from before the verify pass and feeds the kept tokens again
  // (bench --mtp-refeed: the two roll-backs measured side by side).
  void set_take_back(bool on) { take_back_ = on; }
  // After round(): the session is rolled back to hold next, c_1..c_k
  // (k <= a; the generation ended at c_k, or k = 0 to take back all).
  void keep(int64_t k);

 private:
  Session& s_;
  Sampler& sampler_;
  SpecStats* stats_;
  // The session before the last round's verify pass: its position, and a
  // restore point where the state cannot take back (State::keeps_rows).
  int64_t before_pos_ = 0;
  SessionSnapshot before_;
  std::vector<int32_t> verified_;   // next, c_1..c_a of the last round
  DraftOverride override_;
  double forced_ = -1;
  std::mt19937_64 forced_rng_;
  bool logits_wanted_ = true;
  bool take_back_ = true;
  bool forced_keep();  // the next forced-acceptance draw
  Round greedy_round(int32_t next, int64_t n);  // set_logits_wanted(false) under plain greedy
  // Before the verify pass of n tokens: before_pos_, and before_ if needed.
  void mark(int64_t n);
  // The round's end: what was verified, the roll-back to it, the stats.
  void finish(const std::vector<int32_t>& fed, int64_t k, int64_t n);
};

// Session::greedy with speculation: the argmax after what the session holds
// (`last_logits`, its logits), then n-1 more, each fed but the last, with up
// to `draft` drafted tokens per pass; the same tokens as Session::greedy.
// forced_accept >= 0: Speculator::set_forced_acceptance(forced_accept, seed)
// (benchmarks: the tokens are then not the greedy ones). take_back: as
// Speculator::set_take_back.
std::vector<int32_t> greedy_speculative(Session& s, const std::vector<float>& last_logits, int64_t n, int draft,
                                        SpecStats* stats = nullptr, double forced_accept = -1, uint64_t seed = 0,
                                        bool take_back = true);
// The same with any sampler: the token drawn from `last_logits`, then n-1
// more (each fed but the last), in distribution the tokens plain sampling
// gives. `override`: as Speculator::set_draft_override (tests).
std::vector<int32_t> sample_speculative(Session& s, Sampler& sampler, const std::vector<float>& last_logits,
                                        int64_t n, int draft, SpecStats* stats = nullptr,
                                        Speculator::DraftOverride override = {}, double forced_accept = -1,
                                        uint64_t seed = 0, bool take_back = true);

}  // namespace flashmoe
