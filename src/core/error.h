// One exception type for every failure a user can cause (bad file, bad flag,
// bad shape). Front ends catch it, print its message once and exit non-zero.
#pragma once
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace flashmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

[[noreturn]] inline void fail(const std::string& msg) { throw Error(msg); }

// strerror(err), with a hint for the errors that mean "no room to write":
// a full disk, a quota, a file size limit (ulimit -f).
inline std::string errno_text(int err) {
  std::string s = std::strerror(err);
  if (err == ENOSPC) s += " (the disk is full)";
  else if (err == EDQUOT) s += " (the disk quota is used up)";
  else if (err == EFBIG) s += " (a file size limit, ulimit -f, is in effect)";
  return s;
}

}  // namespace flashmoe
