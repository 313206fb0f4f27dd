// Cost of structured output (response_format) per generated token: the
// allowed-token mask of GrammarConstraint on the coder-mini (4k) and qwen3
// (151k) vocabularies, replaying a fixed JSON answer token by token.
//   ./build/json_constraint_bench
// Times are this thread's CPU time. Prints, per vocabulary: the trie build, the mask per token over the answer
// (mean / median / p99 / max, how many masks needed a trie walk), a walk
// from a cold cache in the costliest state (inside a free string, where
// nearly every token is allowed), and a mask under the budget rule (near
// max_tokens, never cached).
#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "engine/json_schema_grammar.h"
#include "engine/token_constraint.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
const fs::path kRoot = fs::path(__FILE__).parent_path().parent_path();

// This thread's CPU time: on a shared machine a wall clock would mostly
// measure the other processes' time slices.
double cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) / 1e6;
}

const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                "zip": {"type": "string", "minLength": 5, "maxLength": 10}}, "required": ["street", "city"]},
    "active": {"type": "boolean"},
    "score": {"type": "number"}
  },
  "required": ["name", "age", "tags", "address", "active"],
  "additionalProperties": false
})";

const char* kAnswer =
    R"({"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada@analytical-engine.org", )"
    R"("tags": ["mathematics", "poetry of science", "notes on the engine"], "address": {"street": "St James's )"
    R"(Square 12", "city": "London", "zip": "SW1Y 4JU"}, "active": false, "score": 98.25})";

void run(const char* label, const std::string& dir) {
  const flashmoe::Tokenizer tok = flashmoe::Tokenizer::load(dir);
  const double t0 = cpu_ms();
  auto trie = std::make_shared<const flashmoe::TokenVocabulary>(tok);
  const double build_ms = cpu_ms() - t0;
  auto grammar = std::make_shared<const flashmoe::Grammar>(flashmoe::json_schema_grammar(json::parse(kSchema)));
  const std::vector<int32_t> ids = tok.encode(kAnswer);
  std::vector<float> logits(tok.vocab_size(), 0.0f);
  const std::vector<int32_t> eos = {tok.token_id("<|endoftext|>")};

  // The answer, token by token, as the generate loop does it (3 rounds;
  // each round starts with an empty cache, the way a request does).
  std::vector<double> per_token;
  size_t walks = 0;
  for (int round = 0; round < 3; ++round) {
    flashmoe::GrammarConstraint c(grammar, trie);
    for (int32_t id : ids) {
      const double t = cpu_ms();
      c.mask(logits, eos, 0);
      per_token.push_back(cpu_ms() - t);
      c.accept(id);
    }
    walks = c.walks();
  }
  std::sort(per_token.begin(), per_token.end());
  double sum = 0;
  for (double x : per_token) sum += x;

  // Inside a free string with a cold cache: the largest walk.
  std::vector<double> cold;
  for (int k = 0; k < 5; ++k) {
    flashmoe::GrammarConstraint c(grammar, trie);
    for (int32_t id : tok.encode(R"({"name": "Ada)")) c.accept(id);
    const double t = cpu_ms();
    c.mask(logits, eos, 0);
    cold.push_back(cpu_ms() - t);
  }
  std::sort(cold.begin(), cold.end());
  // The same state walked over every token of the trie, as the constraint
  // would without the plain-token split (the side-by-side reference).
  std::vector<double> full;
  for (int k = 0; k < 3; ++k) {
    flashmoe::GrammarMatcher m(*grammar);
    m.feed(R"({"name": "Ada)");
    const auto& nodes = trie->all().nodes;
    std::vector<flashmoe::GrammarStacks> level(trie->all().max_depth + 1);
    size_t allowed = 0;
    const double t = cpu_ms();
    level[0] = m.stacks();
    for (size_t i = 0; i < nodes.size();) {
      flashmoe::GrammarMatcher::step(*grammar, level[nodes[i].depth - 1u], nodes[i].byte, level[nodes[i].depth]);
      if (level[nodes[i].depth].empty()) {
        i = nodes[i].subtree_end;
        continue;
      }
      allowed += nodes[i].tokens_end - nodes[i].tokens_begin;
      ++i;
    }
    full.push_back(cpu_ms() - t);
    if (allowed == 0) std::abort();
  }
  std::sort(full.begin(), full.end());
  // The same state under the budget rule (close to max_tokens).
  std::vector<double> tight;
  for (int k = 0; k < 5; ++k) {
    flashmoe::GrammarConstraint c(grammar, trie);
    for (int32_t id : tok.encode(R"({"name": "Ada)")) c.accept(id);
    const double t = cpu_ms();
    c.mask(logits, eos, 40);
    tight.push_back(cpu_ms() - t);
  }
  std::sort(tight.begin(), tight.end());

  std::printf("%-10s vocab %6zu  trie %7zu nodes (%zu plain tokens), built in %6.1f ms\n", label, tok.vocab_size(), trie->all().nodes.size(), trie->plain().size(),
              build_ms);
  std::printf("           answer: %zu tokens, %zu masks walked the trie, %zu came from the cache\n", ids.size(), walks,
              ids.size() - walks);
  std::printf("           mask per token: mean %.3f ms, median %.3f ms, p99 %.3f ms, max %.3f ms\n",
              sum / double(per_token.size()), per_token[per_token.size() / 2],
              per_token[size_t(double(per_token.size()) * 0.99)], per_token.back());
  std::printf("           first mask inside a string: median %.3f ms (walking every token instead: %.3f ms); "
              "under the budget rule: median %.3f ms\n",
              cold[cold.size() / 2], full[full.size() / 2], tight[tight.size() / 2]);
}

}  // namespace

int main() {
  run("coder-mini", (kRoot / "models/coder-mini").string());
  run("qwen3", (kRoot / "tests/fixtures/tokenizers/qwen3").string());
  return 0;
}
