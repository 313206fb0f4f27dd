// Next-token sampling over one row of logits. Semantics follow the reference
// implementations users compare against: logit bias added first (as OpenAI's
// logit_bias), repetition penalty as in HF
// transformers (divide positive logits, multiply negative ones), presence /
// frequency penalties as in the OpenAI API, then temperature -> top-k ->
// top-p -> min-p (HF's warper order), then a draw from a seeded
// std::mt19937_64 so the same seed reproduces the same tokens.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace flashmoe {

struct SamplingParams {
  float temperature = 1.0f;         // <= 0: greedy (argmax)
  int top_k = 0;                    // <= 0: off
  float top_p = 1.0f;               // >= 1: off
  float min_p = 0.0f;               // <= 0: off
  float repetition_penalty = 1.0f;  // 1: off; > 1 discourages seen tokens
  float presence_penalty = 0.0f;    // subtracted once from every seen token
  float frequency_penalty = 0.0f;   // subtracted once per occurrence
  uint64_t seed = 0;
  std::vector<int32_t> eos_ids;     // generation stops on any of these
  // Added to the logit of each listed token before everything else (OpenAI's
  // logit_bias: -100 bans a token, +100 all but forces it).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Whether sampling reads the token history (any penalty on).
  bool uses_history() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
  // Whether a draw is the argmax of the logits as they come (greedy, no
  // bias, no penalty): a backend can then pick the id without the logits.
  bool is_plain_greedy() const { return temperature <= 0.0f && logit_bias.empty() && !uses_history(); }
};

// Defaults from <dir>/generation_config.json (or that file given directly)
// layered over `base`: temperature, top_p, top_k, min_p, repetition_penalty,
// eos_token_id (int or list); do_sample=false means greedy. A missing file
// returns `base` unchanged; a malformed one is an Error.
SamplingParams load_generation_config(const std::string& path, SamplingParams base = {});

class Sampler {
 public:
  explicit Sampler(SamplingParams params);

  // Picks the next token. `history` (prompt + generated ids) feeds the
  // penalties. `logits` is not modified.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history = {});
  // What sample() draws from: bias and penalties applied, then candidates().
  std::vector<std::pair<int32_t, float>> distribution(std::span<const float> logits,
                                                      std::span<const int32_t> history = {});
  // A draw from such a distribution (one candidate: no random number used).
  int32_t draw(const std::vector<std::pair<int32_t, float>>& c);
  // A uniform number in [0, 1) from the sampler's generator.
  double uniform() { return double(rng_() >> 11) * 0x1.0p-53; }

  const SamplingParams& params() const { return params_; }
  void reseed(uint64_t seed) { rng_.seed(seed); }

  // The individual steps, exposed for tests and for callers that fuse them.
  static void apply_logit_bias(std::span<float> logits, const std::vector<std::pair<int32_t, float>>& bias);
  static void apply_repetition_penalty(std::span<float> logits, std::span<const int32_t> history, float penalty);
  static void apply_presence_frequency(std::span<float> logits, std::span<const int32_t> history, float presence,
                                       float frequency);
  // Candidate tokens (id, probability; sorted by probability, descending,
  // renormalised) that survive temperature/top-k/top-p/min-p. Greedy is one
  // candidate with probability 1.
  static std::vector<std::pair<int32_t, float>> candidates(std::span<const float> logits, const SamplingParams& p);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> work_;
};

}  // namespace flashmoe
