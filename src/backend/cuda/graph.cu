// The decode step captured in a CUDA graph per kind of step (no logits,
// logits, logits + argmax) and replayed: one launch per token instead of
// ~320. A state's graphs are dropped when its KV storage moves (ensure_cap).
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"

namespace flashmoe {

void CudaModel::Impl::run_step(CudaState::Impl& s, int kind) {
  if (!use_graph || profiling || host_copies) {  // the copy engine's path waits for the host inside a step
    enqueue_step(s, kind);
    return;
  }
  if (!s.graphs[kind]) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue_step(s, kind);
    } catch (...) {
      cudaStreamEndCapture(stream, &g);
      cudaGetLastError();
      throw;
    }
    CK(cudaStreamEndCapture(stream, &g));
    cudaError_t e = cudaGraphInstantiate(&s.graphs[kind], g, 0);
    cudaGraphDestroy(g);
    check(e, "cudaGraphInstantiate");
  }
  CK(cudaGraphLaunch(s.graphs[kind], stream));
}
}  // namespace flashmoe
