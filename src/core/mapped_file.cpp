#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "core/error.h"

namespace flashmoe {

namespace {

// Every live mapping, so that a SIGBUS (the kernel's answer to touching a
// mapped page that no longer exists: the file was truncated under us, or its
// storage failed) can name the file and end the process with one clear
// message instead of a bare "Bus error". Fixed-size and lock-free: the
// handler may only read plain memory.
constexpr int kMaxGuarded = 256;
constexpr size_t kGuardedPath = 512;
struct Guarded {
  std::atomic<int> state{0};  // 0 free, 1 being written, 2 live
  uintptr_t begin = 0;
  size_t len = 0;
  char path[kGuardedPath] = {};
};
Guarded g_guarded[kMaxGuarded];
struct sigaction g_previous_sigbus;
std::once_flag g_sigbus_installed;

void write_stderr(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w, n -= size_t(w);
  }
}

void on_sigbus(int sig, siginfo_t* si, void* ctx) {
  if (si && si->si_code > 0) {  // raised by the kernel for an access, not sent by kill()
    const uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
    for (const Guarded& g : g_guarded) {
      if (g.state.load(std::memory_order_acquire) != 2 || a < g.begin || a - g.begin >= g.len) continue;
      write_stderr("flashmoe: error: ");
      write_stderr(g.path);
      write_stderr(": the file became unreadable while in use (truncated or replaced in place under the running "
                   "process, or its storage failed); stopping\n");
      ::_exit(1);
    }
  }
  // Not one of ours: whoever handled SIGBUS before (a sanitizer) reports it,
  // else the default action ends the process when the access is retried.
  const struct sigaction& prev = g_previous_sigbus;
  if ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction) {
    prev.sa_sigaction(sig, si, ctx);
    return;
  }
  if (!(prev.sa_flags & SA_SIGINFO) && prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);
}

void install_sigbus_handler() {
  std::call_once(g_sigbus_installed, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous_sigbus);
  });
}

int guard_mapping(const void* p, size_t len, const std::string& path) {
  install_sigbus_handler();
  for (int i = 0; i < kMaxGuarded; ++i) {
    int expect = 0;
    if (!g_guarded[i].state.compare_exchange_strong(expect, 1, std::memory_order_acq_rel)) continue;
    Guarded& g = g_guarded[i];
    g.begin = reinterpret_cast<uintptr_t>(p);
    g.len = len;
    const size_t n = std::min(path.size(), kGuardedPath - 1);
    std::memcpy(g.path, path.data(), n);
    g.path[n] = '\0';
    g.state.store(2, std::memory_order_release);
    return i;
  }
  return -1;  // table full: such a fault ends as a plain SIGBUS
}

}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail("cannot stat " + path + ": " + std::strerror(e));
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail("cannot map " + path + ": " + std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
    guard_ = guard_mapping(p, size_, path);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (guard_ >= 0) g_guarded[guard_].state.store(0, std::memory_order_release);
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open " + path + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace flashmoe
