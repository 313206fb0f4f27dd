#include "server/ids.h"

#include <cstdio>
#include <mutex>
#include <random>

namespace flashmoe::server {

std::string random_id(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx%08llx", (unsigned long long)rng(), (unsigned long long)(rng() >> 32));
  return prefix + std::string(buf);
}

}  // namespace flashmoe::server
