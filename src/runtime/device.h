// Which backend runs the forward pass: --device cpu|cuda|auto, with
// FLASHMOE_DEVICE as the default when --device is not given, and auto when
// neither is.
//
// auto is cuda when a usable GPU is present and this run can execute on the
// CUDA backend, otherwise cpu. Falling back because there is no usable GPU
// is silent (the normal case on a laptop); falling back for any other reason
// (a GPU older than the kernels, weights of another type, logits --hidden,
// a model the GPU cannot take) prints exactly one line
//   flashmoe: note: running on the CPU: <reason>
// to stderr. An explicit cuda never falls back: it fails with the reason.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/qwen_model.h"
#include "runtime/backend.h"

namespace flashmoe {

// How a model runs on a GPU: where the routed experts live
// (--gpu-expert-cache, --gpu-host-cache), and bench's prefill profile.
struct GpuOptions {
  // VRAM for routed experts: GB (>= 0) or a fraction of all expert bytes
  // (>= 0); neither (also --gpu-expert-cache auto): as many as fit beside
  // everything else (runtime/memory_plan.h), every one when they all fit.
  // The rest in pinned host memory.
  double expert_cache_gb = -1, expert_cache_fraction = -1;
  // Pinned host memory for the experts outside VRAM, GB or fraction; neither:
  // all of them, up to the host memory free less a margin. Experts in
  // neither tier are read from the model's files.
  double host_cache_gb = -1, host_cache_fraction = -1;
  // --stats: print the memory plan before the upload.
  bool show_plan = false;
  // The context one conversation's KV cache is planned for.
  int64_t plan_context = 32768;
  // bench --profile: time per phase of the batched prefill, printed to stderr
  // when the model is released.
  bool prefill_profile = false;
  // --gguf-experts stored: GGUF routed experts as the file stores them
  // (DecodeOptions::gguf_expert_chunks false).
  bool gguf_expert_chunks = true;
  // --gpus N (0..N-1) / --devices LIST: the GPUs of an expert-parallel run
  // over NCCL (runtime/multi_gpu_backend.h), one rank each; empty: one GPU
  // without NCCL (the default).
  std::vector<int> devices;
};

// Why a backend cannot run a model: a code to decide on, and a message for
// the user that names the problem (and carries no advice about flags).
enum class ObstacleCode {
  None,
  NoDevice,        // no usable GPU: none, a build without CUDA (silent under auto)
  OldDevice,       // a GPU is there but cannot run the kernels
  CpuOnlyFeature,  // the run uses something only the CPU backend implements
  WeightType,      // weights stored in a type the backend does not read
  DeviceRejected,  // the upload failed (out of device memory, an unsupported shape)
};
struct Obstacle {
  ObstacleCode code = ObstacleCode::None;
  std::string message;
  explicit operator bool() const { return code != ObstacleCode::None; }
};

struct DeviceRequest {
  // --device as given ("" when not given: then FLASHMOE_DEVICE, then auto).
  // After settle_device: "cpu", "cuda", or "auto" (a usable GPU is present and
  // nothing seen so far keeps this run off it; open_backend decides).
  std::string device;
  std::string source;  // after settle: "--device", "FLASHMOE_DEVICE" or "" (the default, auto)
  bool chosen_by_auto = false;  // after settle
  // Set before settle_device when the run uses something only the CPU
  // backend implements (e.g. "--hidden"): auto then picks the CPU, an
  // explicit cuda is an error naming it.
  std::string cpu_only;
  // --gpu-expert-cache / --gpu-host-cache as given (for messages) and parsed.
  std::string gpu_expert_cache, gpu_host_cache;
  // --gpus N / --devices LIST as given (0 / "": not given); parsed into gpu.devices.
  int gpus = 0;
  std::string gpu_list;
  GpuOptions gpu;
  // After settle, when auto picked the CPU: why (the note open_backend
  // prints; empty when there simply is no usable GPU), and the obstacle that
  // kept the GPU out (NoDevice / OldDevice / CpuOnlyFeature, or None).
  std::string cpu_note;
  Obstacle gpu_obstacle;
};

// Whether a GPU the CUDA backend can use is present (None) or why not.
Obstacle gpu_presence();

// Reads FLASHMOE_DEVICE when --device was not given, validates (errors name
// the flag or the variable), and settles what can be settled before the
// model is loaded.
void settle_device(DeviceRequest* req);

// The backend for a loaded model: the CPU, or the GPU for cuda and for auto
// when the GPU can take it (else auto prints its note and returns the CPU).
// An explicit cuda that cannot run throws Error naming what failed.
std::unique_ptr<Backend> open_backend(const DeviceRequest& req, std::shared_ptr<const QwenModel> model);

// "--device cuda" or "FLASHMOE_DEVICE=cuda": how the user asked for the device, for messages.
std::string device_words(const DeviceRequest& req);

// The advice the command line adds to a device failure under an explicit
// --device cuda ("use --device cpu ..."), by kind.
std::string device_advice(DeviceFailure kind);

}  // namespace flashmoe
