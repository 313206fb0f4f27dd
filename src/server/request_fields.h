// Reading fields of a JSON request body (OpenAI's and Anthropic's APIs):
// every wrong type or out-of-range value is an ApiError 400 naming the field.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace flashmoe::server {

[[noreturn]] void bad_field(const std::string& param, const std::string& msg);

// A request body that must be a JSON object (a 400 otherwise).
nlohmann::ordered_json parse_body_object(const std::string& body);

// A present, non-null member, or null.
const nlohmann::ordered_json* field(const nlohmann::ordered_json& o, const char* name);

// Every non-null member of `o` must be in `allowed`: a field the server
// would not act on is an error naming it (prefix + key), never silently dropped.
void only_fields(const nlohmann::ordered_json& o, std::initializer_list<const char*> allowed,
                 const std::string& prefix);

// A finite number in [lo, hi], if present.
std::optional<double> number_field(const nlohmann::ordered_json& o, const char* name, double lo, double hi);

// An integer in [lo, hi], if present; a value outside it (2^64 - 1 included,
// which int64_t cannot hold) is a 400 naming the field and the range.
std::optional<int64_t> integer_field(const nlohmann::ordered_json& o, const char* name, int64_t lo, int64_t hi);

// A boolean; absent is false.
bool boolean_field(const nlohmann::ordered_json& o, const char* name);

}  // namespace flashmoe::server
