// One host thread per rank for a multi-GPU call (multi_gpu.cu): plain C++,
// kept out of the .cu (nvcc fails on the lambda's try/catch there).
#pragma once
#include <functional>

namespace flashmoe {

// f(r) for r in 0..n-1 at once, rank 0 on the calling thread, the others on
// threads of their own; once all are done, the first error (by rank) is
// rethrown.
void run_on_ranks(int n, const std::function<void(int)>& f);

}  // namespace flashmoe
