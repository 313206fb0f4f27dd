// Text in, text out through the real binary: run and chat on coder-mini.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "test_util.h"

namespace cli_text_test {

using namespace flashmoe::test;

namespace {

std::string model() { return source_path("models/coder-mini"); }

TEST(CliRun, GreedyIsDeterministicAndReportsSpeed) {
  std::string args = "run -m " + model() + " -p 'def add(a, b):' -n 12 --temp 0 -t 1";
  CmdResult a = run_flashmoe(args), b = run_flashmoe(args);
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_GT(a.out.size(), 1u);
  EXPECT_NE(a.err.find("tokens/s"), std::string::npos) << a.err;
}

TEST(CliRun, SameSeedSameSampleDifferentSeedDiffers) {
  std::string base = "run -m " + model() + " -p 'import os' -n 24 --temp 1.0 -t 1 --seed ";
  CmdResult a = run_flashmoe(base + "11"), b = run_flashmoe(base + "11"), c = run_flashmoe(base + "12");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out, c.out);
}

TEST(CliRun, StopStringEndsGenerationAndIsNotPrinted) {
  CmdResult full = run_flashmoe("run -m " + model() + " -p 'def add(a, b):' -n 24 --temp 0 -t 1");
  ASSERT_EQ(full.code, 0);
  // Stop on a piece of what greedy decoding produces anyway.
  std::string text = full.out.substr(0, full.out.size() - 1);
  ASSERT_GT(text.size(), 6u);
  std::string stop = text.substr(3, 3);
  CmdResult cut = run_flashmoe("run -m " + model() + " -p 'def add(a, b):' -n 24 --temp 0 -t 1 --stop '" + stop + "'");
  ASSERT_EQ(cut.code, 0) << cut.err;
  EXPECT_EQ(cut.out, text.substr(0, text.find(stop)) + "\n");
}

// "generation: N tokens in ... finish: R" from run's stderr: N and R.
std::pair<int, std::string> generation_summary(const std::string& err) {
  size_t g = err.rfind("generation: ");
  if (g == std::string::npos) return {-1, ""};
  int n = std::stoi(err.substr(g + 12));
  size_t f = err.find("finish: ", g);
  std::string reason = f == std::string::npos ? "" : err.substr(f + 8, err.find('\n', f) - (f + 8));
  return {n, reason};
}

TEST(CliRun, IgnoreEosGeneratesExactlyN) {
  // The end of a script: greedy decoding on coder-mini samples <|endoftext|>
  // after a dozen tokens, long before -n.
  const std::string base = "run -m " + model() + " -p 'if __name__ == \"__main__\":\n    main()\n' -n 48 --temp 0 -t 1";
  CmdResult eos = run_flashmoe(base);
  ASSERT_EQ(eos.code, 0) << eos.err;
  auto [n_eos, why_eos] = generation_summary(eos.err);
  ASSERT_EQ(why_eos, "stop") << "this prompt no longer reaches EOS before -n; pick another\n" << eos.err;
  ASSERT_GT(n_eos, 0);
  ASSERT_LT(n_eos, 48) << eos.err;

  CmdResult all = run_flashmoe(base + " --ignore-eos");
  ASSERT_EQ(all.code, 0) << all.err;
  auto [n_all, why_all] = generation_summary(all.err);
  EXPECT_EQ(n_all, 48) << all.err;
  EXPECT_EQ(why_all, "length") << all.err;
  // Same greedy tokens up to the EOS (whose text is not printed), then more.
  std::string before = eos.out.substr(0, eos.out.size() - 1);
  EXPECT_EQ(all.out.rfind(before, 0), 0u) << "without: " << eos.out << "\nwith: " << all.out;
  EXPECT_GT(all.out.size(), eos.out.size());
}

// run records the conversation's tokens only when a penalty reads them (so a
// long run keeps flat memory); with a penalty on they must still be there.
TEST(CliRun, PenaltiesSeeTheHistory) {
  const std::string base = "run -m " + model() + " -p 'def add(a, b):' -n 32 --temp 0 -t 1";
  CmdResult plain = run_flashmoe(base), pen = run_flashmoe(base + " --repeat-penalty 1.5"),
            freq = run_flashmoe(base + " --frequency-penalty 1.5");
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(pen.code, 0) << pen.err;
  ASSERT_EQ(freq.code, 0) << freq.err;
  EXPECT_NE(plain.out, pen.out);
  EXPECT_NE(plain.out, freq.out);
}

TEST(CliRun, ChatTemplateMode) {
  CmdResult r = run_flashmoe("run -m " + model() + " --chat -p 'hello' -n 4 --temp 0 --show-prompt -t 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", 0), 0u) << r.out;
}

TEST(CliRun, BadInputs) {
  CmdResult empty = run_flashmoe("run -m " + model() + " -p ''");
  EXPECT_NE(empty.code, 0);
  EXPECT_NE(empty.err.find("prompt is empty"), std::string::npos) << empty.err;

  CmdResult utf8 = run_flashmoe("run -m " + model() + " -p \"$(printf 'ab\\377\\376cd')\"");
  EXPECT_NE(utf8.code, 0);
  EXPECT_NE(utf8.err.find("UTF-8"), std::string::npos) << utf8.err;

  CmdResult longp = run_flashmoe("run -m " + model() + " -p 'def a_long_function_name(x, y, z):' -c 5");
  EXPECT_NE(longp.code, 0);
  EXPECT_NE(longp.err.find("longer than the context"), std::string::npos) << longp.err;

  CmdResult flag = run_flashmoe("run -m " + model() + " -p x --frobnicate");
  EXPECT_NE(flag.code, 0);
  EXPECT_NE(flag.err.find("frobnicate"), std::string::npos) << flag.err;

  CmdResult notok = run_flashmoe("run -m " + fixture_dir("tiny-qwen35moe") + "/model -p x");
  EXPECT_NE(notok.code, 0);
  EXPECT_NE(notok.err.find("tokenizer.json"), std::string::npos) << notok.err;
}

TEST(CliChat, SecondTurnReusesTheFirstTurnsState) {
  CmdResult r = run_flashmoe("chat -m " + model() + " -n 8 --temp 0 -t 1", "def add(a, b):\nclass Foo:\n/quit\n");
  ASSERT_EQ(r.code, 0) << r.err;
  size_t first = r.err.find("[0 prompt tokens reused");
  ASSERT_NE(first, std::string::npos) << r.err;
  size_t second = r.err.find(" prompt tokens reused", first + 10);
  ASSERT_NE(second, std::string::npos) << r.err;
  size_t line_start = r.err.rfind('[', second);
  int reused = std::stoi(r.err.substr(line_start + 1));
  EXPECT_GT(reused, 10) << r.err;
}

TEST(CliChat, ResetStartsOver) {
  CmdResult r = run_flashmoe("chat -m " + model() + " -n 4 --temp 0 -t 1", "hello\n/reset\nhello\n");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("(conversation reset)"), std::string::npos);
  // After the reset the second turn starts from nothing again.
  size_t reset = r.err.find("(conversation reset)");
  EXPECT_NE(r.err.find("[0 prompt tokens reused", reset), std::string::npos) << r.err;
}

}  // namespace

}  // namespace cli_text_test
