#include "server/request_fields.h"

#include <cmath>

#include "server/openai_api.h"

namespace flashmoe::server {

using json = nlohmann::ordered_json;

[[noreturn]] void bad_field(const std::string& param, const std::string& msg) {
  throw ApiError(400, msg, "invalid_request_error", "", param);
}

nlohmann::ordered_json parse_body_object(const std::string& body) {
  json o = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (o.is_discarded()) bad_field("", "the request body is not valid JSON");
  if (!o.is_object()) bad_field("", "the request body must be a JSON object");
  return o;
}

// A present, non-null field.
const json* field(const json& o, const char* name) {
  auto it = o.find(name);
  if (it == o.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> number_field(const json& o, const char* name, double lo, double hi) {
  const json* v = field(o, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad_field(name, std::string("'") + name + "' must be a number");
  double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    bad_field(name, std::string("'") + name + "' must be between " + json(lo).dump() + " and " + json(hi).dump());
  return x;
}

// An integer field in [lo, hi]; a value outside it (2^64 - 1 included, which
// int64_t cannot hold) is a 400 naming the field and the range.
std::optional<int64_t> integer_field(const json& o, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(o, name);
  if (!v) return std::nullopt;
  auto out_of_range = [&]() {
    bad_field(name, std::string("'") + name + "' must be an integer between " + std::to_string(lo) + " and " +
                  std::to_string(hi));
  };
  if (v->is_number_unsigned()) {
    uint64_t u = v->get<uint64_t>();
    if (u > uint64_t(hi) || (lo > 0 && u < uint64_t(lo))) out_of_range();
    return int64_t(u);
  }
  if (v->is_number_integer()) {
    int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) out_of_range();
    return x;
  }
  if (v->is_number_float()) {
    double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d)) {
      if (d < double(lo) || d > double(hi)) out_of_range();
      return int64_t(d);
    }
  }
  bad_field(name, std::string("'") + name + "' must be an integer");
}

bool boolean_field(const json& o, const char* name) {
  const json* v = field(o, name);
  if (!v) return false;
  if (!v->is_boolean()) bad_field(name, std::string("'") + name + "' must be a boolean");
  return v->get<bool>();
}

// Every non-null member of `o` must be in `allowed`: a field the server
// would not act on is an error naming it, never silently dropped.
void only_fields(const json& o, std::initializer_list<const char*> allowed, const std::string& prefix) {
  for (auto it = o.begin(); it != o.end(); ++it) {
    if (it.value().is_null()) continue;
    bool ok = false;
    for (const char* a : allowed) ok = ok || it.key() == a;
    if (!ok) {
      const std::string name = prefix + it.key();
      bad_field(name, "'" + name + "' is not supported by this server");
    }
  }
}

}  // namespace flashmoe::server
