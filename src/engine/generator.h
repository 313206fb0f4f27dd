// The generate loop shared by `run`, `chat` and the server: feed the prompt,
// sample, stream complete UTF-8 text, stop on EOS, stop strings, the token
// limit, the context limit or a cancel request.
#pragma once
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "engine/logprobs.h"
#include "engine/sampler.h"
#include "engine/session.h"
#include "engine/speculative.h"
#include "engine/token_constraint.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe {

struct GenerateOptions {
  int max_new_tokens = 256;
  SamplingParams sampling;
  std::vector<std::string> stop;     // stop strings (never emitted)
  int64_t context_limit = 0;         // > 0: stop when the session reaches this many tokens
  const std::atomic<bool>* cancel = nullptr;  // set to true to stop early
  // false: GenerateResult::ids and ::text stay empty (the caller streams the
  // text through on_text and needs only the count), so a long generation does
  // not hold its whole output twice more.
  bool keep_output = true;
  // >= 0: report every generated token's log-probability (engine/logprobs.h)
  // with this many alternatives, through on_logprob (called before the text
  // that token completes is passed to on_text) and GenerateResult::logprobs
  // (with keep_output). An EOS token is reported too.
  int top_logprobs = -1;
  std::function<void(const TokenLogprob&)> on_logprob;
  // Structured output: only tokens the constraint allows are sampled (and
  // an EOS only once the output is complete); it is advanced over each
  // generated token. Not owned; one constraint serves one generate call.
  TokenConstraint* constraint = nullptr;
  // > 0: speculative decoding (--mtp --spec-draft N): the MTP head drafts up
  // to this many tokens per pass (engine/speculative.h). Needs a drafting
  // session; the output is that of plain decoding (token for token when
  // greedy, in distribution when sampling). With a constraint the loop
  // decodes plainly (the grammar would have to judge drafts).
  int spec_draft = 0;
  // Tests: replaces the head's drafts (Speculator::set_draft_override).
  Speculator::DraftOverride draft_override;
};

struct GenerateResult {
  std::vector<int32_t> ids;        // generated ids (including a final EOS, if any); empty without keep_output
  std::string text;                // emitted text; empty without keep_output
  std::vector<TokenLogprob> logprobs;  // with top_logprobs >= 0 and keep_output
  int64_t generated = 0;           // number of generated ids, also without keep_output
  std::string finish_reason;       // "stop" (EOS or stop string), "length", "cancelled"
  std::string stop_string;         // the stop string that ended it, else ""
  int64_t prompt_tokens = 0;
  double prompt_seconds = 0, gen_seconds = 0;
  SpecStats spec;                  // with spec_draft > 0
};

// Feeds `prompt` (must not be empty) on top of what the session holds, then
// generates. on_text receives each piece of text as soon as it is final; it
// may return false to cancel. Every generated token is fed back, so the
// session afterwards holds the whole exchange and a chat can continue.
GenerateResult generate(Session& session, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                        const GenerateOptions& opt, const std::function<bool(const std::string&)>& on_text);

}  // namespace flashmoe
