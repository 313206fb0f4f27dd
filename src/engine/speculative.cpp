#include "engine/speculative.h"

#include <algorithm>
#include <cstdio>
#include <span>
#include <unordered_map>

#include "core/error.h"

namespace flashmoe {

using Dist = std::vector<std::pair<int32_t, float>>;

namespace {

float prob_of(const Dist& d, int32_t id) {
  for (const auto& [i, p] : d)
    if (i == id) return p;
  return 0.0f;
}

// max(0, p - q), renormalised; p itself if that leaves nothing (p <= q
// everywhere can only happen through rounding).
Dist residual(const Dist& p, const Dist& q) {
  std::unordered_map<int32_t, float> qm(q.begin(), q.end());
  Dist r;
  double sum = 0;
  for (const auto& [id, pp] : p) {
    auto it = qm.find(id);
    const float v = pp - (it == qm.end() ? 0.0f : it->second);
    if (v > 0) {
      r.emplace_back(id, v);
      sum += v;
    }
  }
  if (sum <= 0) return p;
  for (auto& x : r) x.second = float(x.second / sum);
  return r;
}

}  // namespace

void SpecStats::add(const SpecStats& o) {
  rounds += o.rounds;
  drafted += o.drafted;
  accepted += o.accepted;
  emitted += o.emitted;
  if (drafted_at.size() < o.drafted_at.size()) drafted_at.resize(o.drafted_at.size());
  if (accepted_at.size() < o.accepted_at.size()) accepted_at.resize(o.accepted_at.size());
  for (size_t i = 0; i < o.drafted_at.size(); ++i) drafted_at[i] += o.drafted_at[i];
  for (size_t i = 0; i < o.accepted_at.size(); ++i) accepted_at[i] += o.accepted_at[i];
}

std::string SpecStats::describe() const {
  char buf[96];
  std::string s = "mtp: " + std::to_string(drafted) + " drafted, " + std::to_string(accepted) + " accepted";
  if (drafted > 0) {
    std::snprintf(buf, sizeof buf, " (%.3f; per position", double(accepted) / double(drafted));
    s += buf;
    for (size_t i = 0; i < drafted_at.size(); ++i) {
      std::snprintf(buf, sizeof buf, " %.3f", drafted_at[i] ? double(accepted_at[i]) / double(drafted_at[i]) : 0.0);
      s += buf;
    }
    s += ")";
  }
  if (rounds > 0) {
    std::snprintf(buf, sizeof buf, ", %.2f tokens per pass (%lld passes)", double(emitted) / double(rounds),
                  static_cast<long long>(rounds));
    s += buf;
  }
  return s;
}

Speculator::Speculator(Session& session, Sampler& sampler, SpecStats* stats)
    : s_(session), sampler_(sampler), stats_(stats) {
  if (!session.drafting()) fail("speculative decoding needs a drafting session (--mtp)");
}

bool Speculator::forced_keep() { return std::uniform_real_distribution<double>(0.0, 1.0)(forced_rng_) < forced_; }

// Under plain greedy sampling p and q are one-hot: a draft is kept when it
// is the verify pass's argmax, and at the first one not kept (or after the
// last) the argmax is the token (the residual of one-hot p and q is p).
Speculator::Round Speculator::greedy_round(int32_t next, int64_t n) {
  const std::vector<int32_t> drafts = s_.draft(next, n, {});
  mark(n + 1);
  std::vector<int32_t> fed{next};
  fed.insert(fed.end(), drafts.begin(), drafts.end());
  const std::vector<int32_t> best = s_.feed_argmax_rows(fed);
  Round r;
  int64_t k = 0;
  for (; k < n; ++k) {
    const int32_t d = drafts[size_t(k)];
    if (!(forced_ >= 0 ? forced_keep() : d == best[size_t(k)])) break;
    r.tokens.push_back(d);
  }
  r.tokens.push_back(best[size_t(k)]);
  r.accepted = k;
  finish(fed, k, n);
  return r;
}

Speculator::Round Speculator::round(int32_t next, int64_t n) {
  if (n < 1) fail("speculative round: nothing to draft");
  if (!logits_wanted_ && !override_ && sampler_.params().is_plain_greedy()) return greedy_round(next, n);
  const bool hist = sampler_.params().uses_history();
  const int64_t V = s_.backend().config().vocab_size;
  // The history the penalties read at each position: what the session
  // holds, then next and the tokens after it.
  std::vector<int32_t> history;
  if (hist) history = s_.tokens();
  history.push_back(next);
  const size_t base = history.size();

  std::vector<Dist> q(static_cast<size_t>(n));
  std::vector<int32_t> drafts = s_.draft(next, n, [&](const float* logits, int64_t k) {
    q[size_t(k)] = sampler_.distribution(std::span<const float>(logits, size_t(V)),
                                         hist ? std::span<const int32_t>(history) : std::span<const int32_t>());
    int32_t d = sampler_.draw(q[size_t(k)]);
    if (override_) {
      const int32_t o = override_(s_.position() + 1 + k, k, d);
      if (o != d || q[size_t(k)].size() != 1) q[size_t(k)] = {{o, 1.0f}};
      d = o;
    }
    history.push_back(d);
    return d;
  });
  history.resize(base);

  mark(n + 1);
  std::vector<int32_t> fed{next};
  fed.insert(fed.end(), drafts.begin(), drafts.end());
  std::vector<float> logits = s_.feed_all(fed);

  Round r;
  auto target = [&](int64_t k) {
    return sampler_.distribution(std::span<const float>(logits.data() + k * V, size_t(V)),
                                 hist ? std::span<const int32_t>(history) : std::span<const int32_t>());
  };
  int64_t k = 0;
  for (; k < n; ++k) {
    const Dist p = target(k);
    const int32_t d = drafts[size_t(k)];
    const float pd = prob_of(p, d), qd = prob_of(q[size_t(k)], d);
    const bool keep = forced_ >= 0 ? forced_keep() : pd >= qd || (pd > 0 && sampler_.uniform() < double(pd) / double(qd));
    if (!keep) {
      r.tokens.push_back(sampler_.draw(residual(p, q[size_t(k)])));
      break;
    }
    r.tokens.push_back(d);
    history.push_back(d);
  }
  r.accepted = k;
  if (k == n) r.tokens.push_back(sampler_.draw(target(n)));
  r.logits.assign(logits.begin(), logits.begin() + (k + 1) * V);
  finish(fed, k, n);
  return r;
}

void Speculator::mark(int64_t n) {
  before_pos_ = s_.position();
  const bool rows = take_back_ && s_.state().keeps_rows(n);
  before_ = rows ? SessionSnapshot{} : s_.rollback_point();
}

void Speculator::finish(const std::vector<int32_t>& fed, int64_t k, int64_t n) {
  verified_.assign(fed.begin(), fed.begin() + k + 1);
  if (k < n) keep(k);
  if (stats_) {
    stats_->rounds++;
    stats_->drafted += n;
    stats_->accepted += k;
    stats_->emitted += k + 1;
    if (stats_->drafted_at.size() < size_t(n)) stats_->drafted_at.resize(size_t(n));
    if (stats_->accepted_at.size() < size_t(n)) stats_->accepted_at.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) stats_->drafted_at[size_t(i)]++;
    for (int64_t i = 0; i < k; ++i) stats_->accepted_at[size_t(i)]++;
  }
}

void Speculator::set_forced_acceptance(double rate, uint64_t seed) {
  if (rate > 1) fail("forced acceptance " + std::to_string(rate) + " is more than 1");
  forced_ = rate;
  forced_rng_.seed(seed);
}

void Speculator::keep(int64_t k) {
  if (k < 0 || size_t(k) + 1 > verified_.size()) fail("speculative round: cannot keep more than was verified");
  const int64_t kept = before_pos_ + int64_t(k) + 1;
  if (s_.position() == kept || (take_back_ && s_.take_back(kept))) return;
  if (!before_.state) fail("speculative round: the state could not take back its verify pass");
  // The GatedDeltaNet and conv states cannot step back (unless the verify
  // pass kept them, as on a GPU): restore the state from before the verify
  // pass and feed what is kept again.
  s_.restore(before_);
  s_.feed(std::vector<int32_t>(verified_.begin(), verified_.begin() + k + 1));
}

std::vector<int32_t> greedy_speculative(Session& s, const std::vector<float>& last_logits, int64_t n, int draft,
                                        SpecStats* stats, double forced_accept, uint64_t seed, bool take_back) {
  SamplingParams greedy;
  greedy.temperature = 0;
  Sampler sampler(greedy);
  return sample_speculative(s, sampler, last_logits, n, draft, stats, {}, forced_accept, seed, take_back);
}

std::vector<int32_t> sample_speculative(Session& s, Sampler& sampler, const std::vector<float>& last_logits,
                                        int64_t n, int draft, SpecStats* stats, Speculator::DraftOverride override,
                                        double forced_accept, uint64_t seed, bool take_back) {
  std::vector<int32_t> out;
  if (n <= 0) return out;
  Speculator spec(s, sampler, stats);
  spec.set_logits_wanted(false);  // only the tokens leave here
  spec.set_take_back(take_back);
  spec.set_draft_override(std::move(override));
  if (forced_accept >= 0) spec.set_forced_acceptance(forced_accept, seed);
  const bool hist = sampler.params().uses_history();
  out.push_back(sampler.sample(last_logits, hist ? s.tokens() : std::vector<int32_t>{}));
  while (int64_t(out.size()) < n) {
    const int32_t next = out.back();
    const int64_t k = std::min<int64_t>(draft, n - int64_t(out.size()) - 1);
    if (k >= 1) {
      Speculator::Round r = spec.round(next, k);
      out.insert(out.end(), r.tokens.begin(), r.tokens.end());
    } else {
      const std::vector<float>& l = s.feed({next});
      out.push_back(sampler.sample(l, hist ? s.tokens() : std::vector<int32_t>{}));
    }
  }
  return out;
}

}  // namespace flashmoe
