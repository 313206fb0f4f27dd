// Log-probabilities of sampled tokens, as OpenAI's `logprobs` reports them:
// the log-softmax of the model's own logits for that position (before logit
// bias, penalties, temperature and the top-k/top-p/min-p cuts), so a value
// means the same whatever sampling settings produced the token. vLLM's
// default (raw logprobs) is the same quantity.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace flashmoe {

struct TokenLogprob {
  int32_t id = -1;
  float logprob = 0;
  // The `top` most likely tokens of the same distribution, most likely first
  // (ties: lower id first).
  std::vector<std::pair<int32_t, float>> top;
};

// log_softmax(logits)[id] and the `top` largest entries (top <= logits.size()).
TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int top);

}  // namespace flashmoe
