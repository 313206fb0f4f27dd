// Which backend runs the forward pass: --device cpu|cuda|auto, with
// FLASHMOE_DEVICE as the default when --device is not given, and auto when
// neither is.
//
// auto is cuda when CudaModel::available() and this run can execute on the
// CUDA backend, otherwise cpu. Falling back because there is no usable GPU
// is silent (the normal case on a laptop); falling back for any other reason
// (a GPU older than the kernels, weights of another type, logits --hidden,
// a model the GPU cannot take) prints exactly one line
//   flashmoe: note: running on the CPU: <reason>
// to stderr. An explicit cuda never falls back: it fails with the reason.
#pragma once
#include <memory>
#include <string>

#include "cli/common.h"

namespace flashmoe::cli {

// Part of finalize_model_options: reads FLASHMOE_DEVICE when --device was not
// given, validates (errors name the flag or the variable), and settles what
// can be settled before the model is loaded (see ModelOptions::device).
void choose_device(ModelOptions* opt);

// Why the CUDA backend cannot run this loaded model ("" when it can): the
// checks that need the weights (experts in memory, storage types).
std::string cuda_obstacle(const QwenModel& m);

// The device copy of `host` for a cuda or auto run, null for the CPU (after
// printing auto's note when it has one). Throws Error for an explicit cuda
// that cannot run.
std::unique_ptr<CudaModel> place_model(const ModelOptions& opt, const QwenModel& host);

// "--device cuda" or "FLASHMOE_DEVICE=cuda": how the user asked for the device, for messages.
std::string device_words(const ModelOptions& opt);

}  // namespace flashmoe::cli
