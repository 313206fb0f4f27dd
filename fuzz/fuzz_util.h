// Shared helpers for the libFuzzer targets: an in-memory file for APIs that
// take a path, and the fixture root baked in at build time.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace flashmoe::fuzz {

inline std::string source_path(const std::string& rel) { return std::string(FLASHMOE_SOURCE_DIR) + "/" + rel; }

// A memfd holding the fuzz input, reachable as /proc/self/fd/N (no disk I/O).
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("flashmoe-fuzz", 0);
    if (fd_ < 0) std::abort();
    size_t done = 0;
    while (done < size) {
      ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) std::abort();
      done += size_t(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace flashmoe::fuzz
