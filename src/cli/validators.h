// Validators for numeric options whose messages read as the user would
// write the range: main.cpp turns a failed one into
// "flashmoe: error: --temp must be >= 0 (got -1)". (CLI11's own Range,
// NonNegativeNumber and PositiveNumber write the largest double instead.)
// Each also rejects a value that is not a number at all.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>

namespace flashmoe::cli {

// Integers (whole numbers only) in [lo, hi]; hi = INT64_MAX means no upper bound.
CLI::Validator integer_between(int64_t lo, int64_t hi);
inline CLI::Validator integer_at_least(int64_t lo) {
  return integer_between(lo, std::numeric_limits<int64_t>::max());
}
// Any integer (e.g. a seed: 0 to 2^64-1).
CLI::Validator unsigned_integer();
// Real numbers: [lo, hi], >= lo, > lo, or any finite number.
CLI::Validator between(double lo, double hi);
CLI::Validator at_least(double lo);
CLI::Validator greater_than(double lo);
CLI::Validator any_number();

}  // namespace flashmoe::cli
