#include "runtime/device.h"

#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "runtime/cpu_backend.h"
#include "runtime/cuda_backend.h"
#include "runtime/multi_gpu_backend.h"

namespace flashmoe {

namespace {

void note_cpu(const std::string& reason) {
  std::fprintf(stderr, "flashmoe: note: running on the CPU: %s\n", reason.c_str());
  std::fflush(stderr);
}

bool gpu_cache_given(const DeviceRequest& r) { return !r.gpu_expert_cache.empty() || !r.gpu_host_cache.empty(); }

}  // namespace

std::string device_words(const DeviceRequest& r) {
  return r.source == "FLASHMOE_DEVICE" ? "FLASHMOE_DEVICE=" + r.device : "--device " + r.device;
}

std::string device_advice(DeviceFailure kind) {
  if (kind == DeviceFailure::OutOfMemory)
    return "use --device cpu, a smaller model (--layers), a smaller --gpu-expert-cache or a smaller KV cache";
  return "use --device cpu";
}

Obstacle gpu_presence() { return cuda_presence(); }

void settle_device(DeviceRequest* req) {
  std::string& d = req->device;
  if (req->source.empty()) {
    const char* env = std::getenv("FLASHMOE_DEVICE");
    if (env && *env) {  // set but empty counts as unset, as for most variables
      d = env;
      req->source = "FLASHMOE_DEVICE";
    } else {
      d = "auto";
    }
  }
  if (d != "cpu" && d != "cuda" && d != "auto")
    fail((req->source == "FLASHMOE_DEVICE" ? "FLASHMOE_DEVICE" : "--device") + std::string(": '") + d +
         "' is not a device (expected cpu, cuda or auto)");
  if (!req->gpu.devices.empty() && d == "cpu")
    fail(std::string(req->gpus > 0 ? "--gpus" : "--devices") + " needs --device cuda or auto" +
         std::string(req->source == "FLASHMOE_DEVICE" ? " (FLASHMOE_DEVICE=cpu selects the CPU)" : ""));
  if (!req->gpu.devices.empty()) {
    // Several GPUs asked for by number: never a silent fall back to the CPU.
    if (!req->cpu_only.empty()) fail(req->cpu_only + " is only available with --device cpu");
    const Obstacle gpu = gpu_presence();
    if (gpu) fail(std::string(req->gpus > 0 ? "--gpus" : "--devices") + ": no usable GPU (" + gpu.message + ")");
    d = "cuda";
    return;
  }
  if (d == "cpu") {
    if (gpu_cache_given(*req))
      fail(std::string(req->gpu_expert_cache.empty() ? "--gpu-host-cache" : "--gpu-expert-cache") +
           " needs --device cuda or auto" +
           std::string(req->source == "FLASHMOE_DEVICE" ? " (FLASHMOE_DEVICE=cpu selects the CPU)" : ""));
    return;
  }
  if (d == "cuda") {
    // Refused before the (slow) upload; the backend would refuse later anyway.
    if (!req->cpu_only.empty()) fail(req->cpu_only + " is only available with --device cpu");
    return;
  }
  req->chosen_by_auto = true;
  std::string reason;
  const Obstacle gpu = gpu_presence();
  if (gpu) {
    req->gpu_obstacle = gpu;
    // No GPU (or a build without CUDA) is the ordinary CPU machine: silent.
    // A GPU that is there but older than the kernels is not: its owner
    // expects it to be used and should learn why it is not.
    if (gpu.code == ObstacleCode::OldDevice) reason = gpu.message;
  } else if (!req->cpu_only.empty()) {
    req->gpu_obstacle = {ObstacleCode::CpuOnlyFeature, req->cpu_only + " is only available on the CPU"};
    reason = req->gpu_obstacle.message;
  } else {
    return;  // stays auto: open_backend decides once the weights are known
  }
  d = "cpu";
  // --gpu-expert-cache with auto describes how to use a GPU if this run gets
  // one, so a script may pass it on every machine: refusing it would make
  // auto fail exactly where it is meant to adapt. Ignoring it silently would
  // hide a GPU gone missing (a driver update, a busy machine), so the note
  // says so even where a plain CPU run would be silent.
  if (!req->gpu_expert_cache.empty()) {
    if (reason.empty()) reason = "no usable GPU (" + gpu.message + ")";
    reason += "; --gpu-expert-cache is ignored";
  }
  req->cpu_note = reason;
}

std::unique_ptr<Backend> open_backend(const DeviceRequest& req, std::shared_ptr<const QwenModel> model) {
  if (req.device == "cpu") {
    if (!req.cpu_note.empty()) note_cpu(req.cpu_note);
    return std::make_unique<CpuBackend>(std::move(model));
  }
  Obstacle obstacle = cuda_weight_obstacle(*model);
  if (req.device == "cuda") {
    const Obstacle gpu = gpu_presence();
    if (gpu) fail(device_words(req) + ": no usable GPU (" + gpu.message + "); " + device_advice(DeviceFailure::Unavailable));
    if (obstacle) fail(device_words(req) + ": " + obstacle.message + "; " + device_advice(DeviceFailure::Unsupported));
    if (!req.gpu.devices.empty()) return make_multi_gpu_backend(std::move(model), req.gpu);
    return make_cuda_backend(std::move(model), req.gpu);
  }
  // auto, with a usable GPU: the GPU unless the weights keep this run off
  // it or the upload fails (out of device memory, an unsupported shape);
  // the host model is loaded either way, so the CPU can take over.
  if (!obstacle) {
    try {
      return make_cuda_backend(model, req.gpu);
    } catch (const Error& e) {
      obstacle = {ObstacleCode::DeviceRejected, std::string("the GPU could not take this model (") + e.what() + ")"};
    }
  }
  note_cpu(obstacle.message + (req.gpu_expert_cache.empty() ? "" : "; --gpu-expert-cache is ignored"));
  return std::make_unique<CpuBackend>(std::move(model));
}

}  // namespace flashmoe
