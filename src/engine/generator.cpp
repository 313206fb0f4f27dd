#include "engine/generator.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "engine/stop.h"

namespace flashmoe {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

GenerateResult generate(Session& session, const Tokenizer& tok, const std::vector<int32_t>& prompt,
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
  GenerateResult r;
  r.prompt_tokens = int64_t(prompt.size());
  auto t0 = Clock::now();
  const std::vector<float>* logits = &session.feed(prompt);
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
  auto t1 = Clock::now();
  for (int i = 0; i < opt.max_new_tokens; ++i) {
    if (opt.cancel && opt.cancel->load()) {
      r.finish_reason = "cancelled";
      break;
    }
    // The session holds every token so far (each sampled one is fed before
    // the next sample), i.e. exactly the history the penalties look at; a
    // session that does not record tokens is only used without penalties.
    const auto& eos = opt.sampling.eos_ids;
    int32_t next;
    if (opt.constraint) {
      masked.assign(logits->begin(), logits->end());
      int64_t budget = opt.max_new_tokens - i;
      if (opt.context_limit > 0) budget = std::min(budget, opt.context_limit - session.position());
      if (!opt.constraint->mask(masked, eos, budget)) {  // complete, and no EOS to say so
        r.finish_reason = "stop";
        break;
      }
      next = sampler.sample(masked, session.tokens());
    } else {
      next = sampler.sample(*logits, session.tokens());
    }
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
      session.feed({next});
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
                             (opt.context_limit > 0 && session.position() + 1 >= opt.context_limit));
    if (s.stopped || value_done) {
      stop_string = s.stopped;
      session.feed({next});
      r.finish_reason = "stop";
      for (const std::string& x : opt.stop)  // StopMatcher counts only the non-empty ones
        if (!x.empty() && s.which-- == 0) r.stop_string = x;
      break;
    }
    if (!keep_going) {
      r.finish_reason = "cancelled";
      break;
    }
    // This token is the last one the context holds (prompt + generated
    // never exceed the limit): it goes into the state, nothing follows.
    if (opt.context_limit > 0 && session.position() + 1 >= opt.context_limit) {
      session.feed({next});
      break;
    }
    logits = &session.feed({next});
  }
  // Text held back as a possible stop string's start is released unless a
  // stop string completed (after an EOS too: the end of a JSON value such
  // as "}" must not vanish because a stop string begins with it).
  if (!stop_string) {
    emit(stops.feed(dec.flush()).text);
    if (!stops.stopped()) emit(stops.flush());
  }
  r.gen_seconds = since(t1);
  return r;
}

}  // namespace flashmoe
