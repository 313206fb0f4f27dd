// Random response and tool-call ids ("chatcmpl-…", "call_…", "msg_…",
// "toolu_…"): unique per process run, not secrets.
#pragma once
#include <string>

namespace flashmoe::server {

// `prefix` followed by 24 random hex digits.
std::string random_id(const char* prefix);

}  // namespace flashmoe::server
