// Line-oriented JSON I/O shared by the tokenizer commands: one JSON value per
// stdin line in, one compact JSON value per stdout line out (flushed per line
// so the commands can sit behind a pipe interactively). Errors name the line.
#pragma once
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace flashmoe::cli {

// Calls fn(line_number, parsed_json) for each stdin line.
inline void for_each_json_line(const std::function<void(size_t, const nlohmann::ordered_json&)>& fn) {
  std::string line;
  size_t n = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (const size_t bad = utf8::find_invalid(line); bad != utf8::npos)
      fail("stdin line " + std::to_string(n) + ": invalid UTF-8 at byte " + std::to_string(bad));
    nlohmann::ordered_json j;
    try {
      j = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("stdin line " + std::to_string(n) + ": not valid JSON (" + e.what() + ")");
    }
    fn(n, j);
  }
}

inline void write_line(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

}  // namespace flashmoe::cli
