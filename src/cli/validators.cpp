#include "cli/validators.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace flashmoe::cli {

namespace {

// A plain number as the user writes it: 0, 1, 0.5, 65535 (never 1.797e308).
std::string plain(double d) {
  std::ostringstream s;
  s.precision(15);
  s << d;
  return s.str();
}

std::string got(const std::string& v) { return " (got '" + v + "')"; }

bool parse_real(const std::string& v, double* d) {
  if (v.empty() || std::isspace(static_cast<unsigned char>(v.front()))) return false;
  char* end = nullptr;
  errno = 0;
  *d = std::strtod(v.c_str(), &end);
  return *end == '\0' && errno != ERANGE && std::isfinite(*d);
}

// No description: the help's type stays INT / FLOAT, and CLI11's "1 required
// FLOAT missing" reads as it should; each option's help text gives its range.
CLI::Validator real(double lo, bool lo_open, double hi, std::string range) {
  return CLI::Validator(
      [=](std::string& v) -> std::string {
        double d = 0;
        if (!parse_real(v, &d)) return "must be a number" + (range.empty() ? "" : " " + range) + got(v);
        const bool low_ok = lo_open ? d > lo : d >= lo;
        if (!low_ok || d > hi) return "must be " + range + " (got " + v + ")";
        return "";
      },
      "");
}

}  // namespace

CLI::Validator integer_between(int64_t lo, int64_t hi) {
  const bool open = hi == std::numeric_limits<int64_t>::max();
  const std::string range =
      open ? ">= " + std::to_string(lo) : "between " + std::to_string(lo) + " and " + std::to_string(hi);
  return CLI::Validator(
      [=](std::string& v) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long n = v.empty() || std::isspace(static_cast<unsigned char>(v.front()))
                                ? 0
                                : std::strtoll(v.c_str(), &end, 10);
        if (v.empty() || end == nullptr || *end != '\0') return "must be an integer " + range + got(v);
        if (errno == ERANGE || n < lo || n > hi) return "must be " + range + " (got " + v + ")";
        return "";
      },
      "");
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        const std::string range = "between 0 and 18446744073709551615";
        char* end = nullptr;
        errno = 0;
        const bool digits = !v.empty() && v.front() >= '0' && v.front() <= '9';
        if (digits) std::strtoull(v.c_str(), &end, 10);
        if (!digits || *end != '\0') return "must be an integer " + range + got(v);
        if (errno == ERANGE) return "must be " + range + " (got " + v + ")";
        return "";
      },
      "");
}

CLI::Validator between(double lo, double hi) {
  return real(lo, false, hi, "between " + plain(lo) + " and " + plain(hi));
}
CLI::Validator at_least(double lo) {
  return real(lo, false, HUGE_VAL, ">= " + plain(lo));
}
CLI::Validator greater_than(double lo) {
  return real(lo, true, HUGE_VAL, "> " + plain(lo));
}
CLI::Validator any_number() { return real(-HUGE_VAL, false, HUGE_VAL, ""); }

}  // namespace flashmoe::cli
