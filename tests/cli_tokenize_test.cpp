// The tokenize / detokenize / chat-template commands, run through the real
// binary exactly as external checkers call them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <sys/wait.h>

#include <nlohmann/json.hpp>

namespace cli_tokenize_test {

using ojson = nlohmann::ordered_json;

namespace {

const std::string kSrc = FLASHMOE_SOURCE_DIR;
const std::string kBin = FLASHMOE_BINARY;

struct CliRun {
  int rc;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `flashmoe <args>` with `input` on stdin.
CliRun run(const std::string& args, const std::string& input) {
  static int counter = 0;
  const std::string base = ::testing::TempDir() + "/cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
  std::ofstream(base + ".in", std::ios::binary) << input;
  const std::string cmd = "'" + kBin + "' " + args + " < '" + base + ".in' > '" + base + ".out' 2> '" + base + ".err'";
  const int status = std::system(cmd.c_str());
  CliRun r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(base + ".out"), slurp(base + ".err")};
  std::remove((base + ".in").c_str());
  std::remove((base + ".out").c_str());
  std::remove((base + ".err").c_str());
  return r;
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string l;
  while (std::getline(ss, l)) out.push_back(l);
  return out;
}

std::vector<ojson> jsonl(const std::string& file) {
  std::vector<ojson> rows;
  for (const auto& l : lines(slurp(file))) rows.push_back(ojson::parse(l));
  return rows;
}

}  // namespace

TEST(CliTokenize, RoundTripsBothDevSets) {
  for (const auto& [name, model] : {std::pair<std::string, std::string>{"qwen3", "tests/fixtures/tokenizers/qwen3"},
                                    {"coder-mini", "models/coder-mini"}}) {
    const auto rows = jsonl(kSrc + "/tests/fixtures/tokenizers/" + name + ".tokenize_dev.jsonl");
    std::string in, ids_in;
    for (const auto& r : rows) in += r["text"].dump() + "\n";
    const CliRun t = run("tokenize -m '" + kSrc + "/" + model + "'", in);
    ASSERT_EQ(t.rc, 0) << t.err;
    const auto out = lines(t.out);
    ASSERT_EQ(out.size(), rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(out[i], rows[i]["ids"].dump()) << name << " line " << i + 1;  // compact: [1,2,3]
      ids_in += out[i] + "\n";
    }
    const CliRun d = run("detokenize -m '" + kSrc + "/" + model + "/tokenizer.json'", ids_in);
    ASSERT_EQ(d.rc, 0) << d.err;
    const auto dec = lines(d.out);
    ASSERT_EQ(dec.size(), rows.size());
    for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(ojson::parse(dec[i]), rows[i]["decoded"]) << name << " line " << i + 1;
  }
}

TEST(CliChatTemplate, RendersBothDevSets) {
  for (const auto& [name, model] :
       {std::pair<std::string, std::string>{"qwen3", "tests/fixtures/tokenizers/qwen3/tokenizer_config.json"},
        {"coder-mini", "models/coder-mini"}}) {
    const auto rows = jsonl(kSrc + "/tests/fixtures/tokenizers/" + name + ".chat_dev.jsonl");
    std::string in;
    for (const auto& r : rows) {
      ojson req = r;
      req.erase("rendered");
      if (req["enable_thinking"].is_null()) req.erase("enable_thinking");  // absent == null
      in += req.dump() + "\n";
    }
    const CliRun c = run("chat-template -m '" + kSrc + "/" + model + "'", in);
    ASSERT_EQ(c.rc, 0) << c.err;
    const auto out = lines(c.out);
    ASSERT_EQ(out.size(), rows.size());
    for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(ojson::parse(out[i]), rows[i]["rendered"]) << name << " line " << i + 1;
  }
}

TEST(CliTokenize, InvalidUtf8IsAClearError) {
  const CliRun r = run("tokenize -m '" + kSrc + "/models/coder-mini'", "\"fine\"\n\"bad \xC3\x28 byte\"\n");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("invalid UTF-8"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("line 2"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.rfind("flashmoe: error: ", 0), 0u) << r.err;
}

TEST(CliTokenize, NonStringLineNamesTheLine) {
  const CliRun r = run("tokenize -m '" + kSrc + "/models/coder-mini'", "\"a\"\n\"b\"\n[1, 2]\n");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("line 3"), std::string::npos) << r.err;
  EXPECT_EQ(lines(r.out).size(), 2u);  // the good lines were answered first
}

TEST(CliTokenize, UnknownFlagAndMissingModelFail) {
  const CliRun r = run("tokenize -m '" + kSrc + "/models/coder-mini' --no-such-flag", "");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--no-such-flag"), std::string::npos) << r.err;
  const CliRun m = run("tokenize -m /nonexistent/model", "\"x\"\n");
  EXPECT_EQ(m.rc, 1);
  EXPECT_NE(m.err.find("tokenizer.json not found"), std::string::npos) << m.err;
  const CliRun n = run("tokenize", "");
  EXPECT_NE(n.rc, 0);  // -m is required
  const CliRun c = run("chat-template -m '" + kSrc + "/models/coder-mini'", "{\"nomessages\": 1}\n");
  EXPECT_EQ(c.rc, 1);
  EXPECT_NE(c.err.find("line 1"), std::string::npos) << c.err;
}

}  // namespace cli_tokenize_test
