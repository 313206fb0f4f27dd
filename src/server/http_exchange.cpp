#include "server/http_exchange.h"

#include <strings.h>

namespace flashmoe::server {

namespace {
bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && strncasecmp(a.data(), b.data(), a.size()) == 0;
}
}  // namespace

std::string HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (same_name(k, name)) return v;
  return "";
}

bool HttpRequest::has_header(std::string_view name) const {
  for (const auto& kv : headers)
    if (same_name(kv.first, name)) return true;
  return false;
}

}  // namespace flashmoe::server
