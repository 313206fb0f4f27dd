// Error checks and device allocation of the CUDA backend: every failure
// becomes a DeviceError (core/error.h) that names the call; what to do about
// it (another device, a smaller model) is the caller's to say.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "core/error.h"

namespace flashmoe::cuda {

inline std::string cuda_msg(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    fail_device(e == cudaErrorMemoryAllocation ? DeviceFailure::OutOfMemory : DeviceFailure::Runtime,
                std::string("CUDA error in ") + what + " (" + cuda_msg(e) + ")");
}
#define CK(x) ::flashmoe::cuda::check((x), #x)

inline void* dev_alloc(size_t bytes, const std::string& what) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 16));
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    char buf[256];
    std::snprintf(buf, sizeof buf, "out of device memory allocating %.1f MB for %s (%.2f of %.2f GB free)",
                  double(bytes) / 1e6, what.c_str(), double(fr) / 1e9, double(tot) / 1e9);
    fail_device(DeviceFailure::OutOfMemory, buf);
  }
  check(e, ("cudaMalloc for " + what).c_str());
  return p;
}

}  // namespace flashmoe::cuda
