// The server's continuous batching (engine/batch_scheduler.h): sessions on
// their own threads, each with its own sampling parameters, share the
// scheduler's steps and get exactly what they get alone; a long prompt is
// admitted in step-budget chunks while a short request keeps decoding.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <random>
#include <thread>

#include "core/argmax.h"
#include "engine/batch_scheduler.h"
#include "engine/generator.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace batch_scheduler_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

bool sanitized() { return std::getenv("FLASHMOE_SANITIZER") != nullptr; }

// Eight requests at once through the scheduler (different prompt lengths,
// started at different times, greedy and seeded sampling with different
// parameters) give the texts each gives alone.
TEST(BatchScheduler, ConcurrentGenerationsEqualTheirRunsAlone) {
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  Tokenizer tok = Tokenizer::load(dir);
  const Backend& b = cpu_of(*model);
  const char* prompts[] = {"def add(a, b):\n",
                           "# A function that reverses a linked list in place, then returns the new head\n",
                           "class Stack:\n    def __init__(self):\n",
                           "import os\n",
                           "SELECT name FROM users WHERE",
                           "// C++: sort a vector of pairs by the second element, descending, stable\nvoid sort_pairs(",
                           "x = [i * i for i in range(10)]\nprint(",
                           "fn main() {\n    let v = vec![1, 2, 3];\n"};
  const int n = 8, tokens = sanitized() ? 4 : 12;
  std::vector<GenerateOptions> opts(n);
  for (int i = 0; i < n; ++i) {
    opts[size_t(i)].max_new_tokens = tokens - i % 3;
    SamplingParams& p = opts[size_t(i)].sampling;
    p.temperature = i % 2 ? 0.0f : 0.6f + 0.1f * float(i);
    p.top_p = 0.9f;
    p.top_k = 20 + i;
    p.seed = 1000 + uint64_t(i);
    p.repetition_penalty = i == 4 ? 1.2f : 1.0f;
  }
  std::vector<std::string> alone(n);
  {
    ThreadPool pool(2);
    for (int i = 0; i < n; ++i) {
      Session s(b, KvConfig{}, pool);
      const GenerateResult g =
          generate(s, tok, tok.encode(prompts[i]), opts[size_t(i)], [](const std::string&) { return true; });
      alone[size_t(i)] = g.text;
      if (opts[size_t(i)].sampling.temperature > 0) continue;
      // Greedy feeds ask for the argmax alone (Session::feed_argmax): the
      // same ids as the argmax of each step's logits.
      Session r(b, KvConfig{}, pool);
      const int64_t V = b.config().vocab_size;
      const std::vector<float>* l = &r.feed(tok.encode(prompts[i]));
      std::vector<int32_t> want;
      for (int t = 0; t < opts[size_t(i)].max_new_tokens; ++t) {
        want.push_back(argmax(l->data(), V));
        if (t + 1 < opts[size_t(i)].max_new_tokens) l = &r.feed({want.back()});
      }
      EXPECT_EQ(g.ids, want) << "request " << i;
    }
  }
  ThreadPool pool(2);
  BatchSchedulerOptions so;
  so.step_tokens = 8;  // prompts take several steps, mixed with other requests' decoding
  BatchScheduler sched(b, pool, so);
  std::mutex mu;
  int64_t mixed_steps = 0, max_sequences = 0;
  sched.set_step_observer([&](const BatchStepInfo& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (s.prompt_tokens > 0 && s.prompt_tokens < s.tokens) ++mixed_steps;
    max_sequences = std::max(max_sequences, s.sequences);
  });
  std::vector<std::string> batched(n);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * i));  // joining at different steps
      Session s(sched, KvConfig{});
      batched[size_t(i)] =
          generate(s, tok, tok.encode(prompts[i]), opts[size_t(i)], [](const std::string&) { return true; }).text;
    });
  for (auto& t : ts) t.join();
  for (int i = 0; i < n; ++i) EXPECT_EQ(batched[size_t(i)], alone[size_t(i)]) << "request " << i;
  EXPECT_GT(mixed_steps, 0) << "no step mixed a prompt chunk with decoding";
  EXPECT_GE(max_sequences, 2);
  EXPECT_EQ(sched.counters().attached, 0);
}

// While a 4,096-token prompt is admitted, a decoding request is in every
// step, and every step holds at most the budget: its inter-token latency is
// one step, not the whole prompt.
// n pseudo-random ids below V (a long prompt whose content does not matter).
std::vector<int32_t> random_ids(int64_t n, int64_t V, unsigned seed) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::mt19937 rng(seed);
  for (auto& t : ids) t = int32_t(rng() % uint32_t(V));
  return ids;
}

// A 256-position window keeps the long-prompt tests cheap: what they measure
// is the scheduling, and attention over thousands of keys would only add time.
KvConfig window_256() {
  KvConfig kv;
  kv.window = 256;
  kv.window_set = true;
  return kv;
}

TEST(BatchScheduler, LongPromptDoesNotStallDecoding) {
  auto model = QwenModel::load(fixture_dir("tiny-qwen35moe") + "/model");
  const Backend& b = cpu_of(*model);
  const int64_t V = model->config().vocab_size, budget = 64;
  const int64_t long_len = sanitized() ? 1024 : 4096;
  ThreadPool pool(2);
  const std::vector<int32_t> long_prompt = random_ids(long_len, V, 5);
  const KvConfig kv = window_256();
  BatchSchedulerOptions so;
  so.step_tokens = budget;
  so.gather = std::chrono::seconds(5);  // every step waits for both sessions: the test is exact
  BatchScheduler sched(b, pool, so);
  std::atomic<const State*> long_state{nullptr}, short_state{nullptr};
  std::mutex mu;
  int64_t long_steps = 0, long_steps_with_short = 0, most_tokens = 0;
  sched.set_step_observer([&](const BatchStepInfo& s) {
    std::lock_guard<std::mutex> lock(mu);
    const bool has_long = std::find(s.states.begin(), s.states.end(), long_state.load()) != s.states.end();
    if (!has_long) return;
    ++long_steps;
    most_tokens = std::max(most_tokens, s.tokens);
    if (std::find(s.states.begin(), s.states.end(), short_state.load()) != s.states.end()) ++long_steps_with_short;
  });

  std::atomic<bool> long_done{false}, short_decoding{false};
  std::thread short_req([&] {
    Session s(sched, kv);
    short_state = &s.state();
    const std::vector<float>* logits = &s.feed({1, 2, 3});
    short_decoding = true;
    while (!long_done) logits = &s.feed({argmax(logits->data(), V)});
  });
  while (!short_decoding) std::this_thread::yield();
  {
    Session s(sched, kv);
    long_state = &s.state();
    s.feed(long_prompt);
    long_done = true;
  }
  short_req.join();
  // Counted in steps, not seconds (a wall-clock gap bound failed on a loaded
  // 2-core machine): the prompt went in budget-sized chunks, and every one
  // of its steps also decoded the other request's next token, so that
  // request waited one step at a time, never for the whole prompt.
  EXPECT_GE(long_steps, long_len / budget);
  EXPECT_EQ(long_steps_with_short, long_steps) << "a step of the long prompt left the decoding request out";
  EXPECT_LE(most_tokens, budget);
}

// A long prompt whose request is cancelled part-way (its client gone)
// leaves at the next step: its feed throws ForwardCancelled, the session
// starts over, the steps stop waiting for it, and a decoding request next
// to it goes on with the tokens it gets alone.
TEST(BatchScheduler, CancelledPromptLeavesWithinAStep) {
  auto model = QwenModel::load(fixture_dir("tiny-qwen35moe") + "/model");
  const Backend& b = cpu_of(*model);
  const int64_t V = model->config().vocab_size, budget = 32, long_len = 2048;
  ThreadPool pool(2);
  const std::vector<int32_t> long_prompt = random_ids(long_len, V, 7);
  const KvConfig kv = window_256();
  BatchSchedulerOptions so;
  so.step_tokens = budget;
  so.gather = std::chrono::milliseconds(50);  // steps wait for both sessions (a loaded machine too)
  BatchScheduler sched(b, pool, so);
  std::atomic<const State*> long_state{nullptr};
  std::atomic<int64_t> long_steps{0};
  std::atomic<bool> cancel{false};
  // The long prompt's client goes away after 3 of its 64 steps.
  sched.set_step_observer([&](const BatchStepInfo& s) {
    if (std::find(s.states.begin(), s.states.end(), long_state.load()) != s.states.end() && ++long_steps == 3)
      cancel = true;
  });
  // The decoding request's ids alone, for comparison.
  const int decode_tokens = 24;
  std::vector<int32_t> alone;
  {
    Session a(b, kv, pool);
    const std::vector<float>* l = &a.feed({5, 6, 7});
    for (int t = 0; t < decode_tokens; ++t) {
      alone.push_back(argmax(l->data(), V));
      l = &a.feed({alone.back()});
    }
  }
  std::atomic<bool> long_started{false};
  std::vector<int32_t> batched;
  std::thread short_req([&] {
    Session s(sched, kv);
    const std::vector<float>* l = &s.feed({5, 6, 7});
    while (!long_started) std::this_thread::yield();
    for (int t = 0; t < decode_tokens; ++t) {
      batched.push_back(argmax(l->data(), V));
      l = &s.feed({batched.back()});
    }
  });
  {
    Session s(sched, kv);
    long_state = &s.state();
    s.set_cancel([&] { return cancel.load(); });
    long_started = true;
    EXPECT_THROW(s.feed(long_prompt), ForwardCancelled);
    EXPECT_EQ(s.position(), 0) << "a cancelled feed leaves a fresh state";
    EXPECT_TRUE(s.tokens().empty());
    // Gone at the step after the cancel: 3 of the prompt's 64 steps ran.
    EXPECT_EQ(long_steps.load(), 3);
    // Not cancelled any more: the session feeds again from the start.
    s.set_cancel({});
    EXPECT_EQ(s.feed({1, 2, 3}).size(), size_t(V));
    EXPECT_EQ(s.position(), 3);
  }
  short_req.join();
  EXPECT_EQ(batched, alone);
  EXPECT_EQ(sched.counters().attached, 0);
  // Cancelled before it was handed in: thrown at once, nothing run.
  Session late(sched, kv);
  late.set_cancel([] { return true; });
  EXPECT_THROW(late.feed({1, 2}), ForwardCancelled);
  EXPECT_EQ(late.position(), 0);
}

// A lone session's decoded tokens run on its own thread; its prompt runs
// on the scheduler's thread, so the many request threads of a server do not
// each keep a prompt chunk's scratch. Either way the same logits as the
// backend's own calls.
TEST(BatchScheduler, LoneSessionsPromptRunsOnTheSchedulersThread) {
  auto model = QwenModel::load(fixture_dir("tiny-qwen35moe") + "/model");
  const Backend& b = cpu_of(*model);
  const int64_t V = model->config().vocab_size;
  ThreadPool pool(2);
  BatchScheduler sched(b, pool);
  std::mutex mu;
  std::vector<std::pair<int64_t, std::thread::id>> steps;  // tokens, the thread that ran the step
  sched.set_step_observer([&](const BatchStepInfo& s) {
    std::lock_guard<std::mutex> lock(mu);
    steps.emplace_back(s.tokens, std::this_thread::get_id());
  });
  const std::vector<int32_t> prompt = random_ids(40, V, 3);
  Session s(sched, KvConfig{});
  Session alone(b, KvConfig{}, pool);
  const std::vector<float> first = alone.feed(prompt);
  EXPECT_EQ(s.feed(prompt), first);
  const int32_t next = int32_t(argmax(first.data(), V));
  EXPECT_EQ(s.feed({next}), alone.feed({next}));
  const std::vector<int32_t> verify = {next, 5, 6, 7};  // a speculative round's size
  EXPECT_EQ(s.feed(verify), alone.feed(verify));
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0].first, 40);
  EXPECT_NE(steps[0].second, std::this_thread::get_id()) << "the prompt ran on the session's thread";
  EXPECT_EQ(steps[1].first, 1);
  EXPECT_EQ(steps[1].second, std::this_thread::get_id()) << "a decoded token was handed to the scheduler";
  EXPECT_EQ(steps[2].first, 4);
  EXPECT_EQ(steps[2].second, std::this_thread::get_id());
}

TEST(BatchScheduler, BadIdFailsOnlyItsOwnRequest) {
  auto model = QwenModel::load(fixture_dir("tiny-qwen35moe") + "/model");
  const Backend& b = cpu_of(*model);
  ThreadPool pool(1);
  BatchScheduler sched(b, pool);
  Session good(sched, KvConfig{}), bad(sched, KvConfig{});
  EXPECT_THROW(bad.feed({int32_t(model->config().vocab_size)}), Error);
  EXPECT_EQ(good.feed({1, 2}).size(), size_t(model->config().vocab_size));
  EXPECT_EQ(good.position(), 2);
  // Session::greedy through the steps equals the backend's own greedy loop.
  Session alone(b, KvConfig{}, pool);
  alone.feed({1, 2});
  EXPECT_EQ(good.greedy(6), alone.greedy(6));
  EXPECT_EQ(good.tokens(), alone.tokens());
}

}  // namespace

}  // namespace batch_scheduler_test
