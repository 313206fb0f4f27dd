#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "core/error.h"
#include "engine/stop.h"

namespace flashmoe {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

namespace {
void generate_into(GenerateResult& r, Session& session, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                   const GenerateOptions& opt, const std::function<bool(const std::string&)>& on_text);
}  // namespace

GenerateResult generate(Session& session, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                        const GenerateOptions& opt, const std::function<bool(const std::string&)>& on_text) {
  GenerateResult r;
  try {
    generate_into(r, session, tok, prompt, opt, on_text);
  } catch (const ForwardCancelled&) {
    // A scheduled session's cancel (Session::set_cancel) ended a feed, the
    // prompt's or a token's: the session has started over (a feed that
    // stops part-way leaves no usable state), the text so far stands.
    r.finish_reason = "cancelled";
  }
  return r;
}

namespace {
void generate_into(GenerateResult& r, Session& session, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                   const GenerateOptions& opt, const std::function<bool(const std::string&)>& on_text) {
  if (prompt.empty()) fail("the prompt is empty");
  // The context holds the prompt and every generated token: a prompt that
  // already fills it leaves no room for even one new token.
  const int64_t used = session.position() + int64_t(prompt.size());
  if (opt.context_limit > 0 && (used > opt.context_limit || (used == opt.context_limit && opt.max_new_tokens > 0)))
    fail("the prompt (" + std::to_string(prompt.size()) + " tokens" +
         (session.position() ? ", after " + std::to_string(session.position()) + " already in the conversation" : "") +
         ") " + (used == opt.context_limit ? "fills" : "is longer than") + " the context of " +
         std::to_string(opt.context_limit) + " tokens (-c); nothing can be generated");
  r.prompt_tokens = int64_t(prompt.size());
  // Plain greedy (no bias, penalty, constraint, log-probabilities or
  // drafts): the sampler would take the argmax of the logits, so the prompt
  // and each token are fed asking for that id alone (picked on a GPU: no
  // logits copied to the host). `picked`: the id after the last token fed.
  const SamplingParams& sp = opt.sampling;
  const bool speculate = opt.spec_draft > 0 && !opt.constraint;
  const bool argmax_only = sp.is_plain_greedy() && !opt.constraint && opt.top_logprobs < 0 && !speculate;
  std::optional<int32_t> picked;
  auto t0 = Clock::now();
  const std::vector<float>* logits = nullptr;
  if (argmax_only) picked = session.feed_argmax(prompt);
  else logits = &session.feed(prompt);
  r.prompt_seconds = since(t0);

  Sampler sampler(opt.sampling);
  StreamDecoder dec(tok, /*skip_special=*/true);
  StopMatcher stops(opt.stop);
  r.finish_reason = "length";
  auto emit = [&](const std::string& piece) {
    if (piece.empty()) return true;
    if (opt.keep_output) r.text += piece;
    return on_text(piece);
  };
  bool stop_string = false;   // ended by a stop string: what it held back is never shown
  std::vector<float> masked;  // the logits with what the constraint forbids at -inf
  if (opt.spec_draft > 0 && !session.drafting()) fail("speculative decoding (--mtp) needs a drafting session");
  std::optional<Speculator> spec;
  if (speculate) {
    spec.emplace(session, sampler, &r.spec);
    spec->set_draft_override(opt.draft_override);
  }
  // The tokens the last speculative round chose (after the token it began
  // with) and the logits each came from; the session already holds all but
  // the last of them, `ahead` of them not yet processed.
  Speculator::Round queued;
  size_t qi = 0;
  int64_t ahead = 0;
  const int64_t V = session.backend().config().vocab_size;
  std::vector<float> row;  // a queued token's logits
  auto t1 = Clock::now();
  for (int i = 0; i < opt.max_new_tokens; ++i) {
    if (opt.cancel && opt.cancel->load()) {
      if (ahead > 0) spec->keep(int64_t(qi));
      r.finish_reason = "cancelled";
      break;
    }
    // Tokens in the conversation before this one (the session may hold
    // some queued ones already).
    const int64_t pos = session.position() - ahead;
    // The session holds every token so far (each sampled one is fed before
    // the next sample), i.e. exactly the history the penalties look at; a
    // session that does not record tokens is only used without penalties.
    const auto& eos = opt.sampling.eos_ids;
    int32_t next;
    if (qi < queued.tokens.size()) {
      next = queued.tokens[qi];
      row.assign(queued.logits.begin() + int64_t(qi) * V, queued.logits.begin() + int64_t(qi + 1) * V);
      logits = &row;
      ++qi;
    } else if (opt.constraint) {
      masked.assign(logits->begin(), logits->end());
      int64_t budget = opt.max_new_tokens - i;
      if (opt.context_limit > 0) budget = std::min(budget, opt.context_limit - pos);
      if (!opt.constraint->mask(masked, eos, budget)) {  // complete, and no EOS to say so
        r.finish_reason = "stop";
        break;
      }
      next = sampler.sample(masked, session.tokens());
    } else if (picked) {
      next = *picked;
    } else {
      next = sampler.sample(*logits, session.tokens());
    }
    // This token is already in the session (a kept draft): then it is
    // never fed below, and ending here takes back what follows it.
    const bool held = ahead > 0;
    if (held) --ahead;
    auto end_here = [&](bool fed) {
      if (held) spec->keep(int64_t(qi) - (fed ? 0 : 1));
      else if (fed) session.feed({next});
    };
    if (opt.keep_output) r.ids.push_back(next);
    if (opt.top_logprobs >= 0) {
      TokenLogprob lp = token_logprob(*logits, next, opt.top_logprobs);
      if (opt.on_logprob) opt.on_logprob(lp);
      if (opt.keep_output) r.logprobs.push_back(std::move(lp));
    }
    ++r.generated;
    bool is_eos = std::find(eos.begin(), eos.end(), next) != eos.end();
    if (is_eos) {
      // The EOS goes into the state too, so a chat continues after it.
      end_here(true);
      r.finish_reason = "stop";
      break;
    }
    if (opt.constraint) opt.constraint->accept(next);
    StopMatcher::Result s = stops.feed(dec.feed(next));
    bool keep_going = emit(s.text);
    // A finished value ends here when no EOS can be generated after it (none
    // configured, or this was the last token allowed): it is complete, not cut.
    const bool value_done = opt.constraint && opt.constraint->finished() &&
                            (eos.empty() || i + 1 == opt.max_new_tokens ||
                             (opt.context_limit > 0 && pos + 1 >= opt.context_limit));
    if (s.stopped || value_done) {
      stop_string = s.stopped;
      end_here(true);
      r.finish_reason = "stop";
      for (const std::string& x : opt.stop)  // StopMatcher counts only the non-empty ones
        if (!x.empty() && s.which-- == 0) r.stop_string = x;
      break;
    }
    if (!keep_going) {
      end_here(false);
      r.finish_reason = "cancelled";
      break;
    }
    // This token is the last one the context holds (prompt + generated
    // never exceed the limit): it goes into the state, nothing follows.
    if (opt.context_limit > 0 && pos + 1 >= opt.context_limit) {
      end_here(true);
      break;
    }
    if (held) continue;
    // Drafts after this token: no more than the tokens still allowed after
    // it can use (the round's last choice is never fed), nor than the
    // context holds.
    int64_t n = 0;
    if (speculate) {
      n = std::min<int64_t>(opt.spec_draft, opt.max_new_tokens - i - 2);
      if (opt.context_limit > 0) n = std::min(n, opt.context_limit - pos - 1);
    }
    if (n >= 1) {
      queued = spec->round(next, n);
      qi = 0;
      ahead = queued.accepted;
      continue;
    }
    if (argmax_only) picked = session.feed_argmax({next});
    else logits = &session.feed({next});
  }
  // Text held back as a possible stop string's start is released unless a
  // stop string completed (after an EOS too: the end of a JSON value such
  // as "}" must not vanish because a stop string begins with it).
  if (!stop_string) {
    emit(stops.feed(dec.flush()).text);
    if (!stops.stopped()) emit(stops.flush());
  }
  r.gen_seconds = since(t1);
}
}  // namespace

}  // namespace flashmoe
