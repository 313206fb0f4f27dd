#include "backend/cuda/rank_threads.h"

#include <exception>
#include <thread>
#include <vector>

namespace flashmoe {

void run_on_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::exception_ptr> err(static_cast<size_t>(n > 0 ? n : 0));
  auto one = [&](int r) {
    try {
      f(r);
    } catch (...) {
      err[static_cast<size_t>(r)] = std::current_exception();
    }
  };
  std::vector<std::thread> th;
  for (int r = 1; r < n; ++r) th.emplace_back(one, r);
  if (n > 0) one(0);
  for (auto& t : th) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

}  // namespace flashmoe
