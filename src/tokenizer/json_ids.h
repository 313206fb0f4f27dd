// Token ids read from tokenizer.json: a JSON number that is not an integer
// in [0, 2^31) would be converted with undefined behaviour (a float beyond
// int's range) or truncated into another id, so each is checked first.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace flashmoe {

inline int32_t json_token_id(const nlohmann::json& v, const std::string& where) {
  if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t(INT32_MAX)) return int32_t(v.get<uint64_t>());
  if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX)
    return int32_t(v.get<int64_t>());
  fail("tokenizer.json: " + where + ": token id " + v.dump() + " is not an integer between 0 and 2147483647");
}

}  // namespace flashmoe
