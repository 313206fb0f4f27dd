// One exception type for every failure a user can cause (bad file, bad flag,
// bad shape). Front ends catch it, print its message once and exit non-zero.
#pragma once
#include <stdexcept>
#include <string>

namespace flashmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

[[noreturn]] inline void fail(const std::string& msg) { throw Error(msg); }

}  // namespace flashmoe
