// Stop strings over streamed text. Text that might be the beginning of a stop
// string is held back until it either completes one (generation stops and
// the stop string is never shown) or is ruled out (then it is released), so a
// client never sees a partial "<|im_" flash up.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace flashmoe {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);  // empty strings are ignored

  struct Result {
    std::string text;     // safe to emit now
    bool stopped = false; // a stop string was completed; `text` ends just before it
    int which = -1;       // index of that stop string
  };

  // Feed newly decoded text (complete UTF-8, e.g. from StreamDecoder).
  // After a stop, further feeds return nothing.
  Result feed(std::string_view text);
  // End of generation without a stop: release what was held back.
  std::string flush();

  bool stopped() const { return stopped_; }
  size_t held_bytes() const { return pending_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace flashmoe
