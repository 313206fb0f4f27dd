#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace flashmoe {

SamplingParams load_generation_config(const std::string& path, SamplingParams p) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string file = fs::is_directory(path, ec) ? (fs::path(path) / "generation_config.json").string() : path;
  if (!fs::exists(file, ec)) return p;
  std::ifstream in(file);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
    if (!j.is_object()) fail("bad generation_config.json (" + file + "): not an object");
    auto num = [&](const char* k, auto& dst) {
      if (j.contains(k) && j[k].is_number()) dst = j[k].get<std::decay_t<decltype(dst)>>();
    };
    num("temperature", p.temperature);
    num("top_p", p.top_p);
    num("top_k", p.top_k);
    num("min_p", p.min_p);
    num("repetition_penalty", p.repetition_penalty);
    if (j.contains("eos_token_id")) {
      const auto& e = j["eos_token_id"];
      if (e.is_number_integer()) p.eos_ids = {e.get<int32_t>()};
      else if (e.is_array()) p.eos_ids = e.get<std::vector<int32_t>>();
    }
    if (j.contains("do_sample") && j["do_sample"].is_boolean() && !j["do_sample"].get<bool>()) p.temperature = 0;
  } catch (const nlohmann::json::exception& e) {
    fail("bad generation_config.json (" + file + "): " + e.what());
  }
  return p;
}

Sampler::Sampler(SamplingParams params) : params_(std::move(params)), rng_(params_.seed) {}

// Both penalties mark the history's tokens in a vocabulary-sized table that
// is kept per thread and cleared again through the history, so a token costs
// O(history) with no sort, hash or allocation (sorting the history every
// token made long runs with a penalty quadratic with a large constant).
namespace {
template <typename T>
std::vector<T>& scratch(size_t n) {
  thread_local std::vector<T> v;
  if (v.size() < n) v.assign(n, T(0));
  return v;
}

using Candidate = std::pair<int32_t, float>;

// Probability descending, then id: the order candidates are drawn and cut
// in. (A lambda object, so that sort and nth_element inline it: as a
// function pointer it made a top-p token 30% slower.)
constexpr auto by_prob = [](const Candidate& a, const Candidate& b) {
  return a.second != b.second ? a.second > b.second : a.first < b.first;
};

// Calls keep_going(i, c[i]) for c's entries in by_prob order, putting them
// in that order a chunk at a time (nth_element, then a sort of the chunk:
// 64, 256, 1,024, ...) only as far as the walk goes; returns the position
// at which keep_going said no, else c.size(). Entries up to that position
// are where sorting them all puts them (sorting a 248k vocabulary took
// milliseconds a token; a walk usually ends in the first chunk).
template <typename F>
size_t walk_by_probability(std::vector<Candidate>& c, F keep_going) {
  size_t i = 0;
  for (size_t done = 0, chunk = 64; done < c.size(); chunk *= 4) {
    const size_t end = std::min(c.size(), done + chunk);
    if (end < c.size()) std::nth_element(c.begin() + ptrdiff_t(done), c.begin() + ptrdiff_t(end - 1), c.end(), by_prob);
    std::sort(c.begin() + ptrdiff_t(done), c.begin() + ptrdiff_t(end), by_prob);
    for (; i < end; ++i)
      if (!keep_going(i, c[i])) return i;
    done = end;
  }
  return c.size();
}
}  // namespace

void Sampler::apply_logit_bias(std::span<float> logits, const std::vector<std::pair<int32_t, float>>& bias) {
  for (const auto& [id, b] : bias)
    if (id >= 0 && size_t(id) < logits.size()) logits[size_t(id)] += b;
}

void Sampler::apply_repetition_penalty(std::span<float> logits, std::span<const int32_t> history, float penalty) {
  if (penalty == 1.0f) return;
  std::vector<uint8_t>& seen = scratch<uint8_t>(logits.size());
  for (int32_t id : history) {
    if (id < 0 || size_t(id) >= logits.size() || seen[size_t(id)]) continue;
    seen[size_t(id)] = 1;
    float& l = logits[size_t(id)];
    l = l < 0 ? l * penalty : l / penalty;  // once per distinct token
  }
  for (int32_t id : history)
    if (id >= 0 && size_t(id) < logits.size()) seen[size_t(id)] = 0;
}

void Sampler::apply_presence_frequency(std::span<float> logits, std::span<const int32_t> history, float presence,
                                       float frequency) {
  if (presence == 0.0f && frequency == 0.0f) return;
  std::vector<int32_t>& counts = scratch<int32_t>(logits.size());
  for (int32_t id : history)
    if (id >= 0 && size_t(id) < logits.size()) ++counts[size_t(id)];
  for (int32_t id : history) {
    if (id < 0 || size_t(id) >= logits.size() || counts[size_t(id)] == 0) continue;
    logits[size_t(id)] -= presence + frequency * float(counts[size_t(id)]);  // once per distinct token
    counts[size_t(id)] = 0;
  }
}

std::vector<std::pair<int32_t, float>> Sampler::candidates(std::span<const float> logits, const SamplingParams& p) {
  if (logits.empty()) fail("sampler: empty logits");
  if (p.temperature <= 0.0f) {
    const auto it = std::max_element(logits.begin(), logits.end());  // first index on ties
    return {{int32_t(it - logits.begin()), 1.0f}};
  }
  const float inv_t = 1.0f / p.temperature;
  const float max_l = *std::max_element(logits.begin(), logits.end());
  // Probabilities over the whole vocab (temperature applied): the
  // exponentials first (kept per thread: no allocation per token), then the
  // candidates. Top-p alone: tokens each below (1 - top_p) / V sum to less
  // than 1 - top_p, so the nucleus never reaches them; they are never made
  // candidates (a pair per vocabulary entry, written and then mostly
  // removed, was half of a sampled token's cost at a 4k vocabulary).
  thread_local std::vector<float> ex;
  ex.resize(logits.size());
  double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    ex[i] = std::exp((logits[i] - max_l) * inv_t);
    sum += ex[i];
  }
  const bool top_k = p.top_k > 0 && size_t(p.top_k) < logits.size();
  const bool nucleus_cut = !top_k && p.top_p < 1.0f;
  const float eps = nucleus_cut ? (1.0f - p.top_p) / float(logits.size()) : 0.0f;
  std::vector<std::pair<int32_t, float>> c;
  if (!nucleus_cut) c.reserve(logits.size());
  // Below `surely_out` a token's float(e / sum) is below eps whatever the
  // roundings (they move it by far less than the 1e-4 margin), so its
  // division is skipped; the others are divided and compared as they are.
  const double surely_out = nucleus_cut ? double(eps) * sum * (1.0 - 1e-4) : -1.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (double(ex[i]) < surely_out) continue;
    const float q = float(ex[i] / sum);
    if (!nucleus_cut || !(q < eps)) c.emplace_back(int32_t(i), q);
  }
  if (top_k) {
    std::nth_element(c.begin(), c.begin() + (p.top_k - 1), c.end(), by_prob);
    const float kth = c[size_t(p.top_k - 1)].second;
    // Like HF, ties with the k-th value stay in.
    auto keep_end = std::partition(c.begin() + p.top_k, c.end(), [&](const auto& x) { return x.second >= kth; });
    c.erase(keep_end, c.end());
  }
  auto renorm = [&] {
    double s = 0;
    for (const auto& x : c) s += x.second;
    for (auto& x : c) x.second = float(x.second / s);
  };
  // Top-p keeps the highest-probability prefix until its mass reaches top_p
  // (the token crossing the threshold stays; HF's "cumprob <= 1 - top_p"
  // rule).
  auto keeps = [&](size_t keep, double cum) { return keep == 0 || cum < p.top_p; };
  if (nucleus_cut && p.top_k <= 0) {
    // Ordered only as far as the nucleus reaches (no renormalisation before
    // the cut, so its sums are the same as after sorting them all).
    double cum = 0;
    c.resize(walk_by_probability(c, [&](size_t i, const Candidate& x) {
      if (!keeps(i, cum)) return false;
      cum += x.second;
      return true;
    }));
    renorm();
  } else {
    std::sort(c.begin(), c.end(), by_prob);
    if (p.top_k > 0) renorm();
    if (p.top_p < 1.0f) {
      double cum = 0;
      size_t keep = 0;
      while (keep < c.size() && keeps(keep, cum)) cum += c[keep++].second;
      c.resize(keep);
      renorm();
    }
  }
  if (p.min_p > 0.0f) {
    const float cut = p.min_p * c.front().second;
    size_t keep = 1;
    while (keep < c.size() && c[keep].second >= cut) ++keep;
    c.resize(keep);
    renorm();
  }
  return c;
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> history) {
  const SamplingParams& p = params_;
  if (p.temperature <= 0.0f || p.top_k > 0 || p.top_p < 1.0f || p.min_p > 0.0f || logits.size() < 2)
    return draw(distribution(logits, history));
  // No filter: the draw of draw(distribution(...)), without sorting the
  // whole vocabulary. The same probabilities as candidates(), walked in the
  // same order and summed in the same order, but ordered only as far as the
  // walk goes (walk_by_probability). Same token for the same seed; the sort
  // was most of a sampled token's cost (a 248k vocabulary: ~15 ms).
  std::span<const float> l = logits;
  const bool penalise = !history.empty() && p.uses_history();
  if (penalise || !p.logit_bias.empty()) {
    work_.assign(logits.begin(), logits.end());
    apply_logit_bias(work_, p.logit_bias);
    apply_repetition_penalty(work_, history, p.repetition_penalty);
    apply_presence_frequency(work_, history, p.presence_penalty, p.frequency_penalty);
    l = work_;
  }
  const float inv_t = 1.0f / p.temperature;
  const float max_l = *std::max_element(l.begin(), l.end());
  thread_local std::vector<std::pair<int32_t, float>> c;
  c.clear();
  c.reserve(l.size());
  double sum = 0;
  for (size_t i = 0; i < l.size(); ++i) {
    const float e = std::exp((l[i] - max_l) * inv_t);
    sum += e;
    c.emplace_back(int32_t(i), e);
  }
  for (auto& x : c) x.second = float(x.second / sum);
  const double u = uniform();
  double cum = 0;
  const size_t at = walk_by_probability(c, [&](size_t, const Candidate& x) {
    cum += x.second;
    return !(u < cum);
  });
  if (at < c.size()) return c[at].first;
  for (auto it = c.rbegin(); it != c.rend(); ++it)  // as draw(): rounding left u past the sum
    if (it->second > 0) return it->first;
  return c.front().first;
}

std::vector<std::pair<int32_t, float>> Sampler::distribution(std::span<const float> logits,
                                                             std::span<const int32_t> history) {
  std::span<const float> l = logits;
  const bool penalise = !history.empty() && params_.uses_history();
  if (penalise || !params_.logit_bias.empty()) {
    work_.assign(logits.begin(), logits.end());
    apply_logit_bias(work_, params_.logit_bias);
    apply_repetition_penalty(work_, history, params_.repetition_penalty);
    apply_presence_frequency(work_, history, params_.presence_penalty, params_.frequency_penalty);
    l = work_;
  }
  return candidates(l, params_);
}

int32_t Sampler::draw(const std::vector<std::pair<int32_t, float>>& c) {
  if (c.empty()) fail("sampler: no candidates");
  if (c.size() == 1) return c[0].first;
  // 53 random bits -> [0, 1): the same on every standard library, unlike
  // std::uniform_real_distribution.
  const double u = uniform();
  double cum = 0;
  for (const auto& [id, prob] : c) {
    cum += prob;
    if (u < cum) return id;
  }
  // Rounding left u past the sum: the last token with any probability (a
  // masked token, at probability 0, must never be drawn).
  for (auto it = c.rbegin(); it != c.rend(); ++it)
    if (it->second > 0) return it->first;
  return c.front().first;
}

}  // namespace flashmoe
