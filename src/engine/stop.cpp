#include "engine/stop.h"

#include <algorithm>

namespace flashmoe {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

StopMatcher::Result StopMatcher::feed(std::string_view text) {
  Result r;
  if (stopped_) return r;
  pending_ += text;
  // Earliest complete stop string wins (ties: the one listed first).
  size_t best = std::string::npos;
  for (size_t k = 0; k < stops_.size(); ++k) {
    const size_t pos = pending_.find(stops_[k]);
    if (pos < best) {
      best = pos;
      r.which = int(k);
    }
  }
  if (best != std::string::npos) {
    r.text = pending_.substr(0, best);
    r.stopped = stopped_ = true;
    pending_.clear();
    return r;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  // Held text never contains a complete stop string, and anything released
  // cannot start one (that would be a longer held tail).
  size_t hold = 0;
  for (const auto& s : stops_) {
    for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n) {
      if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  r.text = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return r;
}

std::string StopMatcher::flush() {
  std::string out;
  if (!stopped_) out.swap(pending_);
  pending_.clear();
  return out;
}

}  // namespace flashmoe
