// Fault injection through the real binary: files that change under a running
// model, a disk that fills up or refuses writes while `pack` runs. Each must
// end with one clear `flashmoe: error: ...` line and exit status 1 (never a
// signal), and leave nothing behind that looks like valid output.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "engine/session.h"
#include "format/safetensors.h"
#include "model/pack_model.h"
#include "model/qwen_model.h"
#include "server_process.h"
#include "test_util.h"

namespace faults_test {

using namespace flashmoe;
using namespace flashmoe::test;
namespace fs = std::filesystem;

namespace {

// A child `flashmoe` with stdin and stderr on pipes (stdout to a file), so a
// test can let it load, wait for a line it prints, change files under it,
// then feed it more input. Deterministic: every step waits for the child to
// say it is done, no sleeps.
struct ChildLimits {
  std::optional<rlim_t> fsize;  // RLIMIT_FSIZE (a disk that fills up at this file size)
  bool drop_root = false;       // run as nobody when the test runs as root (permission tests)
  std::string binary = {};      // instead of FLASHMOE_BINARY (a copy nobody can execute)
};

class Child {
 public:
  Child(const std::vector<std::string>& args, const ChildLimits& lim = {}) {
    out_path_ = out_dir_.path + "/stdout";
    // Everything the child needs is prepared here: after fork() it only makes system calls.
    std::string bin = lim.binary.empty() ? std::string(FLASHMOE_BINARY) : lim.binary;
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    argv.push_back(bin.data());
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    int in[2], err[2];
    if (::pipe(in) != 0 || ::pipe(err) != 0) throw std::runtime_error("pipe");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(err[1], 2);
      int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(out, 1);
      ::close(in[0]), ::close(in[1]), ::close(err[0]), ::close(err[1]), ::close(out);
      if (lim.fsize) {
        rlimit r{*lim.fsize, *lim.fsize};
        ::setrlimit(RLIMIT_FSIZE, &r);
      }
      if (lim.drop_root && ::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(99);
      ::execv(bin.c_str(), argv.data());
      ::_exit(98);
    }
    ::close(in[0]);
    ::close(err[1]);
    in_ = in[1];
    err_ = err[0];
  }
  ~Child() {
    if (in_ >= 0) ::close(in_);
    if (pid_ > 0 && status_ < 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (err_ >= 0) ::close(err_);
  }

  void send(const std::string& s) {
    ASSERT_EQ(::write(in_, s.data(), s.size()), ssize_t(s.size()));
  }
  void close_stdin() {
    ::close(in_);
    in_ = -1;
  }
  // Reads stderr until `needle` shows up (true) or the child closes it / 60 s pass (false).
  bool wait_for(const std::string& needle) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (err_text_.find(needle, scanned_) == std::string::npos) {
      const int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0 || !read_some(left)) return false;
    }
    scanned_ = err_text_.find(needle, scanned_) + needle.size();
    return true;
  }
  // Waits for the exit; returns the status as waitpid gives it.
  int wait() {
    while (read_some(60000)) {
    }
    int st = 0;
    ::waitpid(pid_, &st, 0);
    status_ = st;
    return st;
  }
  const std::string& err() const { return err_text_; }
  std::string out() const { return read_file(out_path_); }

 private:
  bool read_some(int timeout_ms) {
    pollfd p{err_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return false;
    char buf[4096];
    ssize_t n = ::read(err_, buf, sizeof buf);
    if (n <= 0) return false;
    err_text_.append(buf, size_t(n));
    return true;
  }
  TempDir out_dir_;
  std::string out_path_;
  pid_t pid_ = -1;
  int in_ = -1, err_ = -1, status_ = -1;
  std::string err_text_;
  size_t scanned_ = 0;
};

// Exit status 1 with one `flashmoe: error:` line containing every needle; no
// death by signal, no internal error.
void expect_clean_failure(int st, const std::string& err, const std::vector<std::string>& needles) {
  ASSERT_FALSE(WIFSIGNALED(st)) << "killed by signal " << WTERMSIG(st) << "; stderr: " << err;
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 1) << err;
  EXPECT_NE(err.find("flashmoe: error: "), std::string::npos) << err;
  EXPECT_EQ(err.find("internal error"), std::string::npos) << err;
  for (const auto& n : needles) EXPECT_NE(err.find(n), std::string::npos) << "missing '" << n << "' in: " << err;
}

// models/coder-mini packed once (bf16) through the CLI, tokenizer included;
// each test works on its own copy.
const std::string& packed_coder_mini() {
  static TempDir dir;
  static const std::string packed = [] {
    const std::string p = dir.path + "/cm";
    CmdResult r = run_flashmoe("pack -m " + source_path("models/coder-mini") + " -o " + p);
    if (r.code != 0) throw std::runtime_error("pack failed: " + r.err);
    return p;
  }();
  return packed;
}

std::string copy_tree(const std::string& from, const TempDir& into, const std::string& name) {
  const std::string to = into.path + "/" + name;
  fs::copy(from, to, fs::copy_options::recursive);
  return to;
}

// An unpacked bundle (model/ + tokenizer files) copy of models/coder-mini.
std::string copy_coder_mini_bundle(const TempDir& into) {
  const std::string to = into.path + "/bundle";
  fs::create_directories(to + "/model");
  for (const char* f : {"model/config.json", "model/generation_config.json", "model/model.safetensors",
                        "tokenizer.json", "tokenizer_config.json"})
    copy_file(source_path(std::string("models/coder-mini/") + f), to + "/" + f);
  return to;
}

void truncate_expert_files(const std::string& dir, off_t size) {
  for (const auto& e : fs::directory_iterator(dir + "/experts"))
    ASSERT_EQ(::truncate(e.path().c_str(), size), 0) << e.path();
}

// Chat, scripted: turn 1 runs on intact files; `fault` then damages them while
// the process holds them open / mapped; turn 2 must fail cleanly.
int chat_with_fault_between_turns(const std::string& model, const std::vector<std::string>& extra,
                                  const std::function<void()>& fault, std::string* err, std::string* out = nullptr) {
  std::vector<std::string> args = {"chat", "-m", model, "-n", "4", "--temp", "0", "-t", "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  Child c(args);
  c.send("def add(a, b):\n");
  EXPECT_TRUE(c.wait_for("generated at")) << "turn 1 did not finish: " << c.err();
  fault();
  c.send("class Stack:\n");
  c.close_stdin();
  const int st = c.wait();
  *err = c.err();
  if (out) *out = c.out();
  return st;
}

// tiny-qwen35moe-text with 64 experts per layer instead of 16 (experts 16..63
// repeat 0..15), so that each expert file is larger than the non-expert
// weights: a file size limit between the two fails pack inside the experts.
std::string make_many_expert_checkpoint(const TempDir& into) {
  const std::string src = fixture_dir("tiny-qwen35moe-text") + "/model", dir = into.path + "/many";
  fs::create_directories(dir);
  nlohmann::json cfg = nlohmann::json::parse(read_file(src + "/config.json"));
  const int64_t E = cfg["num_experts"].get<int64_t>();
  cfg["num_experts"] = 4 * E;
  write_file(dir + "/config.json", cfg.dump());
  SafetensorsFile st(src + "/model.safetensors");
  std::vector<TensorToWrite> out;
  std::vector<std::vector<uint8_t>> routers;
  const std::string ex = ".mlp.experts.";
  for (const auto& n : st.names()) {
    TensorView t = st.get(n);
    out.push_back({n, t.dtype, t.shape, t.data});
    if (const size_t at = n.find(ex); at != std::string::npos) {
      const size_t dot = n.find('.', at + ex.size());
      const int64_t e = std::stoll(n.substr(at + ex.size(), dot - at - ex.size()));
      for (int k = 1; k < 4; ++k)
        out.push_back({n.substr(0, at + ex.size()) + std::to_string(e + k * E) + n.substr(dot), t.dtype, t.shape, t.data});
    } else if (n.size() > 16 && n.compare(n.size() - 16, 16, ".mlp.gate.weight") == 0) {
      std::vector<uint8_t> r;
      for (int k = 0; k < 4; ++k) r.insert(r.end(), t.data, t.data + t.nbytes());
      routers.push_back(std::move(r));
      out.back().shape[0] *= 4;
      out.back().data = nullptr;  // filled below, once routers stops moving
    }
  }
  size_t r = 0;
  for (auto& t : out)
    if (!t.data) t.data = routers[r++].data();
  write_safetensors(dir + "/model.safetensors", out);
  return dir;
}

}  // namespace

// (a) Streaming store: the expert files are truncated after the model has
// loaded (the manifest's size check has passed, the files are open).
TEST(Faults, StreamedExpertFileTruncatedWhileRunning) {
  TempDir t;
  const std::string m = copy_tree(packed_coder_mini(), t, "m");
  std::string err;
  const int st = chat_with_fault_between_turns(m, {"--expert-cache", "0"}, [&] { truncate_expert_files(m, 4096); }, &err);
  expect_clean_failure(st, err, {"short read of " + m + "/experts/layer-", "the file is truncated", "re-run flashmoe pack"});
}

// Overwritten in place (same size, other bytes): every read is checksummed.
TEST(Faults, StreamedExpertFileOverwrittenWhileRunning) {
  TempDir t;
  const std::string m = copy_tree(packed_coder_mini(), t, "m");
  std::string err;
  const int st = chat_with_fault_between_turns(m, {"--expert-cache", "0"}, [&] {
    for (const auto& e : fs::directory_iterator(m + "/experts")) {
      const std::string zeros(size_t(fs::file_size(e.path())), '\0');
      int fd = ::open(e.path().c_str(), O_WRONLY);
      ASSERT_EQ(::pwrite(fd, zeros.data(), zeros.size(), 0), ssize_t(zeros.size()));
      ::close(fd);
    }
  }, &err);
  expect_clean_failure(st, err, {m + "/experts/layer-", "fails its checksum", "re-run flashmoe pack"});
}

// Replaced by rename or deleted: the process holds the old files open, so it
// goes on with the data it was started with, the answer identical to an
// undisturbed run.
// The same fault under serve: the request that meets it gets a 5xx (the
// server's fault, not the client's), the reason goes to the server's log,
// and the server keeps answering, with /health at 503.
TEST(Faults, StreamedExpertFileOverwrittenUnderServeIs500AndLogged) {
  using namespace flashmoe::test::serve;
  TempDir t;
  const std::string m = copy_tree(packed_coder_mini(), t, "m");
  std::vector<std::string> args = standard_args();
  args.insert(args.end(), {"--expert-cache", "0"});
  ServerProcess srv(args, m);
  ASSERT_NE(srv.port(), 0) << srv.failure_log();
  auto c = srv.client();
  int status = 0;
  post_json(c, "/v1/completions", {{"prompt", "def add(a, b):"}, {"max_tokens", 4}, {"temperature", 0}}, &status);
  ASSERT_EQ(status, 200);
  for (const auto& e : fs::directory_iterator(m + "/experts")) {
    const std::string zeros(size_t(fs::file_size(e.path())), '\0');
    int fd = ::open(e.path().c_str(), O_WRONLY);
    ASSERT_EQ(::pwrite(fd, zeros.data(), zeros.size(), 0), ssize_t(zeros.size()));
    ::close(fd);
  }
  const json err = post_json(c, "/v1/completions", {{"prompt", "class Stack:"}, {"max_tokens", 4}}, &status);
  EXPECT_EQ(status, 500);
  EXPECT_EQ(err["error"]["type"], "server_error") << err.dump();
  EXPECT_NE(err["error"]["message"].get<std::string>().find("server's log"), std::string::npos) << err.dump();
  EXPECT_EQ(err.dump().find(m), std::string::npos) << "file names stay in the log: " << err.dump();
  const std::string log = srv.log();
  EXPECT_NE(log.find("flashmoe serve: error: a request failed: "), std::string::npos) << log;
  EXPECT_NE(log.find("fails its checksum"), std::string::npos) << log;
  // The server answers, but /health tells a load balancer that its model
  // fails (it said "ok" while every request failed).
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_EQ(json::parse(h->body, nullptr, false)["status"], "error") << h->body;
  EXPECT_EQ(h->body.find(m), std::string::npos) << h->body;
  // A request that cannot run is still the client's 4xx.
  post_json(c, "/v1/completions", {{"prompt", ""}, {"max_tokens", 4}}, &status);
  EXPECT_EQ(status, 400);
}

TEST(Faults, StreamedExpertFilesRenamedOverOrDeletedWhileRunningKeepOldData) {
  TempDir t;
  const std::string m = copy_tree(packed_coder_mini(), t, "m");
  std::string err, out, ref_err, ref_out;
  ASSERT_EQ(chat_with_fault_between_turns(m, {"--expert-cache", "0"}, [] {}, &ref_err, &ref_out), 0) << ref_err;
  const int st = chat_with_fault_between_turns(m, {"--expert-cache", "0"}, [&] {
    write_file(m + "/garbage", std::string(size_t(fs::file_size(m + "/experts/layer-000.bin")), 'x'));
    ASSERT_EQ(::rename((m + "/garbage").c_str(), (m + "/experts/layer-000.bin").c_str()), 0);
    ASSERT_EQ(::unlink((m + "/experts/layer-001.bin").c_str()), 0);
    ASSERT_EQ(::chmod((m + "/experts/layer-002.bin").c_str(), 0), 0);
  }, &err, &out);
  ASSERT_TRUE(WIFEXITED(st)) << err;
  EXPECT_EQ(WEXITSTATUS(st), 0) << err;
  EXPECT_EQ(out, ref_out);
}

// (a) In-memory store over mmapped packed files: truncation makes the mapped
// pages disappear, and the next touch is SIGBUS; the handler names the file.
TEST(Faults, MmappedExpertFileTruncatedWhileRunning) {
  TempDir t;
  const std::string m = copy_tree(packed_coder_mini(), t, "m");
  std::string err;
  const int st = chat_with_fault_between_turns(m, {"--expert-store", "mmap"}, [&] { truncate_expert_files(m, 0); }, &err);
  expect_clean_failure(st, err, {m + "/experts/layer-", "the file became unreadable while in use", "truncated"});
}

// The same for the main safetensors weights of an unpacked checkpoint.
TEST(Faults, MmappedWeightsTruncatedWhileRunning) {
  TempDir t;
  const std::string b = copy_coder_mini_bundle(t);
  std::string err;
  const int st = chat_with_fault_between_turns(b, {}, [&] {
    ASSERT_EQ(::truncate((b + "/model/model.safetensors").c_str(), 0), 0);
  }, &err);
  expect_clean_failure(st, err, {b + "/model/model.safetensors: the file became unreadable while in use"});
}

// A forward pass that fails part-way leaves no half-advanced state behind:
// the session starts over, and once the file is back the same tokens give
// the same logits as a fresh session (chat and serve reuse sessions).
TEST(Faults, FailedForwardPassDoesNotLeaveCorruptedState) {
  TempDir t;
  const std::string dir = t.path + "/p";
  pack_model(fixture_dir("tiny-qwen35moe") + "/model", dir, PackOptions{});
  ExpertOptions o;
  o.store = "stream";
  o.cache_mb = 0;
  auto model = QwenModel::load(dir, o);
  ThreadPool pool(1);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8}, b = {9, 10, 11, 12};
  std::vector<int32_t> all = a;
  all.insert(all.end(), b.begin(), b.end());

  Session s(cpu_of(*model), KvConfig{}, pool);
  s.feed(a);
  const std::string f = dir + "/experts/layer-002.bin";  // layers 0 and 1 run before the failure
  const std::string bytes = read_file(f);
  ASSERT_EQ(::truncate(f.c_str(), 0), 0);
  EXPECT_THROW(s.feed(b), Error);
  EXPECT_TRUE(s.tokens().empty());
  EXPECT_EQ(s.position(), 0);
  write_file(f, bytes);
  const std::vector<float> got = s.feed(all);
  Session fresh(cpu_of(*model), KvConfig{}, pool);
  EXPECT_EQ(got, fresh.feed(all));
}

// (c) The disk fills up while pack writes (a file size limit stands in for
// it: writes past it fail with EFBIG): at the first file, then in the middle
// of the expert files. Nothing that looks like a pack may be left.
TEST(Faults, PackOnFullDiskFailsAndLeavesNothing) {
  TempDir t;
  TempDir src;
  const std::string hf = make_many_expert_checkpoint(src);
  // Sizes of an unrestricted pack, to put the limit inside the expert files.
  ASSERT_EQ(run_flashmoe("pack -m " + hf + " -o " + t.path + "/ok").code, 0);
  const auto weights = fs::file_size(t.path + "/ok/model.safetensors");
  const auto layer = fs::file_size(t.path + "/ok/experts/layer-000.bin");
  ASSERT_LT(weights + 8192, layer);
  fs::remove_all(t.path + "/ok");

  struct Case {
    rlim_t limit;
    std::string file;
  };
  for (const Case& c : {Case{4096, "/model.safetensors"}, Case{weights + 8192, "/experts/layer-000.bin"}}) {
    const std::string out = t.path + "/out";
    Child ch({"pack", "-m", hf, "-o", out}, ChildLimits{.fsize = c.limit});
    ch.close_stdin();
    const int st = ch.wait();
    expect_clean_failure(st, ch.err(), {"cannot write " + out + ".tmp-", c.file + ": File too large", "ulimit -f",
                                        out + " was not created"});
    EXPECT_FALSE(fs::exists(out)) << c.limit;
    EXPECT_TRUE(fs::is_empty(t.path)) << "left behind in " << t.path << " (limit " << c.limit << ")";
  }
  // An existing target is refused before anything is written, and kept as it was.
  fs::create_directories(t.path + "/out");
  write_file(t.path + "/out/keep", "mine");
  Child ch({"pack", "-m", hf, "-o", t.path + "/out"}, ChildLimits{.fsize = 4096});
  ch.close_stdin();
  expect_clean_failure(ch.wait(), ch.err(), {"already exists"});
  EXPECT_EQ(read_file(t.path + "/out/keep"), "mine");
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()), 1);
}

// (c) An output directory that cannot be written to.
// SIGTERM during pack: the pack stops, removes its temporary directory and
// ends by SIGTERM (so a shell sees 143). Deterministic: the child starts with
// SIGTERM blocked and already pending; pack unblocks it when it installs its
// handler, so the signal lands before the first expert is written.
TEST(Faults, PackInterruptedBySigtermLeavesNothing) {
  TempDir t;
  const std::string out = t.path + "/out", err_file = t.path + "/err", model = source_path("models/coder-mini");
  const std::string bin = FLASHMOE_BINARY;
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &block, &old), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(bin.c_str(), bin.c_str(), "pack", "-m", model.c_str(), "-o", out.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGTERM), 0);  // pending in the child until pack unblocks it
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  const std::string err = read_file(err_file);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << status << "\n" << err;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  EXPECT_NE(err.find("flashmoe: error: interrupted by a signal; pack stopped, " + out + " was not created"),
            std::string::npos)
      << err;
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(t.path))
    EXPECT_EQ(e.path().filename().string().find("out.tmp-"), std::string::npos) << "left behind: " << e.path();
}

TEST(Faults, PackIntoUnwritableDirectoryFails) {
  TempDir t;
  ::chmod(t.path.c_str(), 0755);  // the unprivileged child must reach the read-only directory
  // The unprivileged child gets its own copies of the binary and the model:
  // the checkout itself may sit in a directory only root can enter.
  const std::string bin = t.path + "/flashmoe", model = t.path + "/model";
  fs::copy_file(FLASHMOE_BINARY, bin);
  fs::copy(fixture_dir("tiny-qwen35moe") + "/model", model);
  for (const std::string& p : {bin, model}) ::chmod(p.c_str(), 0755);
  for (const auto& e : fs::directory_iterator(model)) ::chmod(e.path().c_str(), 0644);
  const std::string ro = t.path + "/ro";
  fs::create_directories(ro);
  ::chmod(ro.c_str(), 0555);
  Child ch({"pack", "-m", model, "-o", ro + "/out"}, ChildLimits{.fsize = std::nullopt, .drop_root = true, .binary = bin});
  ch.close_stdin();
  const int st = ch.wait();
  ::chmod(ro.c_str(), 0755);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 99) GTEST_SKIP() << "running as root and cannot drop privileges";
  expect_clean_failure(st, ch.err(), {"cannot create a directory next to " + ro + "/out", "Permission denied"});
  EXPECT_TRUE(fs::is_empty(ro));
}

// (d) Output files of other commands: a missing directory or a full disk is
// a clean error, and no partial file is left under the output's name.
TEST(Faults, LogitsOutputUnwritable) {
  TempDir t;
  const std::string model = fixture_dir("tiny-qwen35moe") + "/model";
  CmdResult r = run_flashmoe("logits -m " + model + " --ids 1,2,3 -o " + t.path + "/no/such/dir/l.safetensors");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("cannot write " + t.path + "/no/such/dir/l.safetensors"), std::string::npos) << r.err;
  Child ch({"logits", "-m", model, "--ids", "1,2,3", "-o", t.path + "/l.safetensors"}, ChildLimits{.fsize = 1024});
  ch.close_stdin();
  expect_clean_failure(ch.wait(), ch.err(), {"cannot write " + t.path + "/l.safetensors", "File too large"});
  EXPECT_TRUE(fs::is_empty(t.path));
}

}  // namespace faults_test
