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

// A failure of a compute device (a GPU), typed so that callers decide what
// to do from the kind, not from the text: the runtime falls back to the CPU
// under --device auto, the server answers 503 for OutOfMemory, the command
// line adds its own advice. The message names what failed and nothing else.
enum class DeviceFailure {
  Unavailable,  // no usable device (none, too old, a build without it)
  Unsupported,  // the model or the options need something this backend lacks
  OutOfMemory,  // device memory ran out
  Runtime,      // a device call failed
};

class DeviceError : public Error {
 public:
  DeviceError(DeviceFailure kind, const std::string& msg) : Error(msg), kind_(kind) {}
  DeviceFailure kind() const { return kind_; }

 private:
  DeviceFailure kind_;
};

[[noreturn]] inline void fail_device(DeviceFailure kind, const std::string& msg) { throw DeviceError(kind, msg); }

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
