// Issue #27: one error path for the whole command line. Every bad option
// value, unknown command, out-of-range id or context overflow is answered by
// exactly one line "flashmoe: error: ..." naming the flag or value and the
// accepted range in plain numbers, and exit code 1 (README, "Errors");
// --help and --version exit 0.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <regex>

#include "test_util.h"

namespace cli_options_test {

using namespace flashmoe::test;

namespace {

std::string model() { return source_path("models/coder-mini"); }

size_t count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + needle.size())) ++n;
  return n;
}

// One line "flashmoe: error: ...", exit code 1, naming `flag` exactly once and
// `expect` (the accepted range) in plain numbers.
void expect_one_error(const CmdResult& r, const std::string& flag, const std::string& expect,
                      const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("flashmoe: error: ", 0), 0u) << r.err;
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
  EXPECT_EQ(count(r.err, "flashmoe: error:"), 1u) << r.err;
  if (!flag.empty()) {
    EXPECT_EQ(count(r.err, flag), 1u) << r.err;
  }
  EXPECT_NE(r.err.find(expect), std::string::npos) << "expected '" << expect << "' in: " << r.err;
  EXPECT_EQ(r.err.find("179769313486"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

struct BadOption {
  std::string flag;                // as given and as named in the message
  std::vector<std::string> values; // each one rejected
  std::string range;               // what the message says is accepted
};

const std::vector<BadOption> kModelOptions = {
    {"--threads", {"-1", "abc", "1.5"}, "between 0 and 2147483647"},
    {"--expert-cache", {"-1", "x"}, ">= 0"},
    {"--io-threads", {"0", "x"}, "between 1 and 2147483647"},
    {"--max-memory", {"0", "-2", "x"}, "> 0"},
};
const std::vector<BadOption> kKvOptions = {
    {"--kv-window", {"0", "x"}, ">= 1"},        {"--kv-h2o", {"0", "x"}, ">= 1"},
    {"--kv-sinks", {"-1", "x"}, ">= 0"},        {"--kv-recent", {"x", "nan"}, "must be a number"},
    {"--kv-streaming", {"-3", "x"}, ">= 1"},   {"--kv-tova", {"0", "x"}, ">= 1"},
};
const std::vector<BadOption> kGenerationOptions = {
    {"--n-predict", {"-1", "abc"}, "between 0 and 2147483647"},
    {"--ctx-size", {"-1", "x"}, ">= 0"},
    {"--temp", {"-1", "x"}, ">= 0"},
    {"--top-k", {"-1", "x"}, "between 0 and 2147483647"},
    {"--top-p", {"1.5", "-0.1", "x"}, "between 0 and 1"},
    {"--min-p", {"2", "x"}, "between 0 and 1"},
    {"--repeat-penalty", {"0", "-1", "x"}, "> 0"},
    {"--presence-penalty", {"x", "nan"}, "must be a number"},
    {"--frequency-penalty", {"x", "inf"}, "must be a number"},
    {"--seed", {"-1", "x"}, "between 0 and 18446744073709551615"},
};

struct Command {
  std::string name, required;  // the command and the options it cannot run without
  std::vector<std::vector<BadOption>> options;
};

std::vector<Command> commands() {
  const std::string m = " -m " + model();
  const std::vector<BadOption> serve = {
      {"--port", {"65536", "-1", "x"}, "between 0 and 65535"},
      {"--parallel", {"0", "257"}, "between 1 and 256"},
      {"--queue", {"-1", "4097"}, "between 0 and 4096"},
      {"--batch-gather", {"-1", "1000001", "x"}, "between 0 and 1000000"},
      {"--max-body", {"0", "x"}, ">= 1"},
      {"--state-cache", {"-1"}, ">= 0"},
      {"--state-cache-mb", {"0"}, ">= 1"},
      {"--max-tokens", {"0"}, "between 1 and 2147483647"},
      {"--ctx-size", {"-1", "x"}, ">= 0"},
  };
  const std::vector<BadOption> bench = {
      {"--n-prompt", {"-1", "1000001"}, "between 0 and 1000000"},
      {"--n-gen", {"-1", "x"}, "between 0 and 1000000"},
      {"--depth", {"-1"}, "between 0 and 1000000"},
      {"--repetitions", {"0", "1001"}, "between 1 and 1000"},
      {"--layers", {"-1"}, "between 0 and 2147483647"},
      {"--group", {"0"}, "between 1 and 2147483647"},
      {"--profile", {"-1"}, "between 0 and 2147483647"},
  };
  return {
      {"run", m + " -p hi", {kModelOptions, kKvOptions, kGenerationOptions}},
      {"chat", m, {kModelOptions, kKvOptions, kGenerationOptions}},
      {"serve", m, {kModelOptions, kKvOptions, serve}},
      {"generate", m + " --ids 1", {kModelOptions, kKvOptions, {{"--n-predict", {"-1", "x"}, "between 0 and 2147483647"}}}},
      {"logits", m + " --ids 1 -o /nonexistent/l.safetensors", {kModelOptions, kKvOptions}},
      {"eval",
       m,
       {kModelOptions,
        kKvOptions,
        {{"--window-tokens", {"1", "x"}, "between 2 and 1099511627776"}, {"--max-windows", {"-1"}, ">= 0"}}}},
      {"bench", m, {kModelOptions, kKvOptions, bench}},
      {"pack", m + " -o /nonexistent/out", {{{"--group", {"0", "x"}, "between 1 and 2147483647"}}}},
      {"kv-calc", " --preset qwen3.5-35b-a3b", {kKvOptions}},
  };
}

// Each case starts a process; under the sanitizers a start costs ~0.3 s,
// so there only each option's first bad value is tried (its parse and
// message code runs all the same); the Release suite tries them all.
TEST(CliOptions, EveryNumericOptionRejectsBadValuesOnOneLine) {
  const size_t per_option = sanitizer_build() ? 1 : SIZE_MAX;
  for (const Command& c : commands())
    for (const auto& group : c.options)
      for (const BadOption& o : group)
        for (size_t i = 0; i < o.values.size() && i < per_option; ++i) {
          const std::string args = c.name + c.required + " " + o.flag + " " + o.values[i];
          expect_one_error(run_flashmoe(args), o.flag, o.range + " (got ", args);
        }
}

TEST(CliOptions, IssueExamplesReadAsTheUserWouldWriteThem) {
  CmdResult t = run_flashmoe("run -m " + model() + " -p hi --temp -1");
  EXPECT_EQ(t.code, 1);
  EXPECT_EQ(t.err, "flashmoe: error: --temp must be >= 0 (got -1)\n");
  CmdResult n = run_flashmoe("run -m " + model() + " -p hi -n abc");
  EXPECT_EQ(n.code, 1);
  EXPECT_EQ(n.err, "flashmoe: error: --n-predict must be an integer between 0 and 2147483647 (got 'abc')\n");
}

TEST(CliOptions, OtherParseErrorsAreOneLineWithExitCode1) {
  expect_one_error(run_flashmoe("run -m " + model() + " -p hi --no-such-flag"), "--no-such-flag", "not expected", "extra");
  expect_one_error(run_flashmoe("run -m " + model()), "--prompt", "required", "missing -p");
  expect_one_error(run_flashmoe("run -m " + model() + " -p hi --temp"), "--temp", "--temp", "missing value");
}

TEST(CliOptions, UnknownCommandIsNamedAndTheCommandsListed) {
  CmdResult r = run_flashmoe("frobnicate");
  expect_one_error(r, "'frobnicate'", "unknown command 'frobnicate' (commands: ", "unknown command");
  for (const char* c : {"run", "chat", "serve", "generate", "logits", "eval", "bench", "pack", "kv-calc", "tokenize",
                        "detokenize"})
    EXPECT_NE(r.err.find(std::string(" ") + c), std::string::npos) << c << ": " << r.err;
  expect_one_error(run_flashmoe(""), "", "no command given (commands: logits, generate, pack, run, chat", "no command");
}

TEST(CliOptions, HelpAndVersionExitZero) {
  for (const char* c : {"run", "chat", "serve", "generate", "logits", "eval", "bench", "pack", "kv-calc", "tokenize",
                        "detokenize", "chat-template"}) {
    CmdResult r = run_flashmoe(std::string(c) + " --help");
    EXPECT_EQ(r.code, 0) << c << ": " << r.err;
    EXPECT_NE(r.out.find(c), std::string::npos) << c << ": " << r.out;
    EXPECT_NE(r.out.find("--help"), std::string::npos) << c << ": " << r.out;
    EXPECT_EQ(r.err, "") << c;
  }
  CmdResult h = run_flashmoe("--help");
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("kv-calc"), std::string::npos) << h.out;
  CmdResult v = run_flashmoe("--version");
  EXPECT_EQ(v.code, 0);
  EXPECT_NE(v.out.find("flashmoe "), std::string::npos) << v.out;
}

TEST(CliOptions, DetokenizeRejectsIdsOutsideTheVocabulary) {
  for (const char* bad : {"[99999]", "[-1]", "[1, 4096]"}) {
    CmdResult r = run_flashmoe("detokenize -m " + model(), std::string(bad) + "\n");
    const std::string id = std::string(bad) == "[99999]" ? "99999" : std::string(bad) == "[-1]" ? "-1" : "4096";
    expect_one_error(r, "token id " + id, "token id " + id + " is out of range: the vocabulary has 4096 tokens (0..4095)",
                     bad);
  }
  CmdResult ok = run_flashmoe("detokenize -m " + model(), "[0, 4095]\n");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

TEST(CliOptions, KvCalcAcceptsTheBundleFolderLikeEveryCommand) {
  CmdResult bundle = run_flashmoe("kv-calc -m " + model());
  ASSERT_EQ(bundle.code, 0) << bundle.err;
  CmdResult dir = run_flashmoe("kv-calc -m " + model() + "/model");
  ASSERT_EQ(dir.code, 0) << dir.err;
  CmdResult file = run_flashmoe("kv-calc -m " + model() + "/model/config.json");
  ASSERT_EQ(file.code, 0) << file.err;
  // The report names the path it was given; the numbers are the same.
  auto numbers = [](std::string s) { return s.substr(s.find('\n')); };
  EXPECT_EQ(numbers(bundle.out), numbers(dir.out));
  EXPECT_EQ(numbers(bundle.out), numbers(file.out));
}

int64_t stat_of(const std::string& err, const std::string& what) {
  std::smatch m;
  if (!std::regex_search(err, m, std::regex(what + ": (\\d+) tokens"))) return -1;
  return std::stoll(m[1]);
}

TEST(CliOptions, ContextLimitCountsPromptAndGeneratedTokens) {
  const std::string base = "run -m " + model() + " -p 'def add(a, b):' --temp 0 -t 1 --ignore-eos";
  CmdResult probe = run_flashmoe(base + " -n 1");
  ASSERT_EQ(probe.code, 0) << probe.err;
  const int64_t p = stat_of(probe.err, "prompt");
  ASSERT_GT(p, 1);
  CmdResult r = run_flashmoe(base + " -n 100 -c " + std::to_string(p + 5));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(stat_of(r.err, "prompt"), p);
  EXPECT_EQ(stat_of(r.err, "generation"), 5) << "prompt + generated must be exactly -c: " << r.err;
  CmdResult one_left = run_flashmoe(base + " -n 100 -c " + std::to_string(p + 1));
  ASSERT_EQ(one_left.code, 0) << one_left.err;
  EXPECT_EQ(stat_of(one_left.err, "generation"), 1) << one_left.err;
  expect_one_error(run_flashmoe(base + " -c " + std::to_string(p)), "",
                   "fills the context of " + std::to_string(p) + " tokens (-c)", "full");
  expect_one_error(run_flashmoe(base + " -c 1"), "", "is longer than the context of 1 tokens (-c)", "-c 1");
  expect_one_error(run_flashmoe(base + " -c 65537"), "--ctx-size",
                   "--ctx-size must be between 1 and 65536, the model's context (max_position_embeddings) (got 65537)",
                   "above max_position_embeddings");
  CmdResult at_max = run_flashmoe(base + " -n 2 -c 65536");
  EXPECT_EQ(at_max.code, 0) << at_max.err;
}

TEST(CliOptions, StatsLineNamesExpertsOnce) {
  CmdResult r = run_flashmoe("run -m " + model() + " -p hi -n 2 --temp 0 -t 1 --stats");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("experts: "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("experts: experts:"), std::string::npos) << r.err;
}

// Peak RSS (MiB) of one flashmoe process, measured by wait4 on it alone.
double peak_rss_mib(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string bin = FLASHMOE_BINARY;
  argv.push_back(bin.data());
  std::vector<std::string> a = args;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int devnull = open("/dev/null", O_RDWR);
    dup2(devnull, 0);
    dup2(devnull, 1);
    dup2(devnull, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  rusage ru{};
  if (wait4(pid, &status, 0, &ru) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return double(ru.ru_maxrss) / 1024.0;
}

TEST(CliOptions, BenchPeakMemoryIsTheModelsNotTheBandwidthProbes) {
  const double mib = peak_rss_mib({"bench", "-m", model(), "-p", "8", "-n", "4", "-r", "1", "-t", "1"});
  ASSERT_GT(mib, 0) << "bench failed";
  EXPECT_LT(mib, 200.0) << "peak RSS " << mib << " MiB (the model needs ~46 MiB)";
}

}  // namespace

}  // namespace cli_options_test
