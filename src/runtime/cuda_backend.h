// The CUDA backend behind the runtime interface (backend/cuda/cuda_model.h
// adapted): states in device memory, calls serialised in arrival order,
// since one CudaModel runs one call at a time (one stream, shared scratch).
#pragma once
#include <memory>

#include "runtime/backend.h"
#include "runtime/device.h"

namespace flashmoe {

// Whether a usable GPU is present (None), else NoDevice or OldDevice.
Obstacle cuda_presence();
// What in a loaded model keeps it off the CUDA backend (WeightType), or None.
Obstacle cuda_weight_obstacle(const QwenModel& m);
// Uploads `model`; throws DeviceError / Error when the GPU cannot take it.
std::unique_ptr<Backend> make_cuda_backend(std::shared_ptr<const QwenModel> model, const GpuOptions& o);

}  // namespace flashmoe
