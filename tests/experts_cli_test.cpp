// The command-line front door of expert streaming: pack, then run the packed
// model with the streaming options and --stats.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>

#include "experts_test_util.h"

namespace experts_cli_test {

using namespace flashmoe::test;

namespace {

// Runs a shell command, returns its exit status and combined output.
int run(const std::string& cmd, std::string* out) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  out->clear();
  while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out->append(buf.data(), n);
  int st = ::pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace

TEST(ExpertsCli, PackThenStreamWithStats) {
  TempDir tmp;
  const std::string bin = FLASHMOE_BINARY, hf = source_path("tests/fixtures/tiny-qwen35moe/model");
  const std::string packed = tmp / "q4";
  std::string out;
  ASSERT_EQ(run(bin + " pack -m " + hf + " -o " + packed + " --experts q4", &out), 0) << out;
  EXPECT_NE(out.find("8/8 layers"), std::string::npos) << out;
  ASSERT_EQ(run(bin + " generate -m " + packed + " --ids 1,2,3 -n 4 --greedy --stats --expert-cache 0 "
                "--expert-cache-policy lfu --io-threads 2",
                &out),
            0)
      << out;
  EXPECT_NE(out.find("hit rate"), std::string::npos) << out;
  EXPECT_NE(out.find("tokens/s"), std::string::npos) << out;
  EXPECT_NE(out.find("streaming (q4"), std::string::npos) << out;
  // User errors: one clear message, exit status 1.
  EXPECT_EQ(run(bin + " pack -m " + hf + " -o " + packed, &out), 1);
  EXPECT_NE(out.find("already exists"), std::string::npos) << out;
  EXPECT_EQ(run(bin + " generate -m " + packed + " --ids 1 --expert-cache-policy mru", &out), 1);
  EXPECT_NE(out.find("--expert-cache-policy"), std::string::npos) << out;
  EXPECT_EQ(run(bin + " generate -m " + packed + " --ids 1 --max-memory 0.001", &out), 1);
  EXPECT_NE(out.find("cannot fit"), std::string::npos) << out;
}

}  // namespace experts_cli_test
