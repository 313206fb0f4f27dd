#include "cli/device.h"

#include <cstdio>
#include <cstdlib>
#include <optional>

#include "core/error.h"
#include "model/qwen_model.h"

namespace flashmoe::cli {

namespace {

void note_cpu(const std::string& reason) {
  std::fprintf(stderr, "flashmoe: note: running on the CPU: %s\n", reason.c_str());
  std::fflush(stderr);
}

// The CUDA backend's errors end with advice for an explicit --device cuda
// ("; use --device cpu ..."), which reads wrong in a note that already says
// the run is on the CPU.
std::string without_advice(std::string msg) {
  const size_t at = msg.find("; use --device cpu");
  if (at != std::string::npos) msg.resize(at);
  return msg;
}

}  // namespace

std::string device_words(const ModelOptions& opt) {
  return opt.device_source == "FLASHMOE_DEVICE" ? "FLASHMOE_DEVICE=" + opt.device : "--device " + opt.device;
}

void choose_device(ModelOptions* opt) {
  std::string& d = opt->device;
  if (opt->device_source.empty()) {
    const char* env = std::getenv("FLASHMOE_DEVICE");
    if (env && *env) {  // set but empty counts as unset, as for most variables
      d = env;
      opt->device_source = "FLASHMOE_DEVICE";
    } else {
      d = "auto";
    }
  }
  if (d != "cpu" && d != "cuda" && d != "auto")
    fail((opt->device_source == "FLASHMOE_DEVICE" ? "FLASHMOE_DEVICE" : "--device") + std::string(": '") + d +
         "' is not a device (expected cpu, cuda or auto)");
  if (d == "cpu") {
    if (!opt->gpu_expert_cache.empty() || !opt->gpu_host_cache.empty())
      fail(std::string(opt->gpu_expert_cache.empty() ? "--gpu-host-cache" : "--gpu-expert-cache") +
           " needs --device cuda or auto" +
           std::string(opt->device_source == "FLASHMOE_DEVICE" ? " (FLASHMOE_DEVICE=cpu selects the CPU)" : ""));
    return;
  }
  if (d == "cuda") {
    // Refused before the (slow) upload; the backend would refuse later anyway.
    if (!opt->cpu_only.empty()) fail(opt->cpu_only + " is only available with --device cpu");
    return;
  }
  opt->device_auto = true;
  std::string why, reason;
  if (!CudaModel::available(&why)) {
    opt->no_gpu = why;
    // No GPU (or a build without CUDA) is the ordinary CPU machine: silent.
    // A GPU that is there but older than the kernels is not: its owner
    // expects it to be used and should learn why it is not.
    if (why.rfind("GPU ", 0) == 0) reason = why;
  } else if (!opt->cpu_only.empty()) {
    reason = opt->cpu_only + " is only available on the CPU";
  } else {
    return;  // stays auto: place_model decides once the weights are known
  }
  d = "cpu";
  // --gpu-expert-cache with auto describes how to use a GPU if this run gets
  // one, so a script may pass it on every machine: refusing it would make
  // auto fail exactly where it is meant to adapt. Ignoring it silently would
  // hide a GPU gone missing (a driver update, a busy machine), so the note
  // says so even where a plain CPU run would be silent.
  if (!opt->gpu_expert_cache.empty()) {
    if (reason.empty()) reason = "no usable GPU (" + why + ")";
    reason += "; --gpu-expert-cache is ignored";
  }
  opt->cpu_note = reason;
}

std::string cuda_obstacle(const QwenModel& m) {
  // Routed experts in any format (checkpoint, packed bf16/q8/q4, mmapped or
  // streamed) are read through the expert store at upload; the other
  // weights must be floats or q8/q4 (an MLX checkpoint's, dequantised to
  // f32 at upload).
  std::optional<DType> other;
  auto check = [&](const Matrix& x) {
    if (x.empty() || x.quantized()) return;
    if (x.dtype != DType::F32 && x.dtype != DType::F16 && x.dtype != DType::BF16) other = x.dtype;
  };
  auto check_ffn = [&](const FfnExpert& e) {
    check(e.gate);
    check(e.up);
    check(e.down);
  };
  const ModelWeights& w = m.weights();
  check(w.embed);
  check(w.lm_head);
  for (const LayerWeights& l : w.layers) {
    for (const Matrix* x : {&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj, &l.attn.o_proj, &l.lin.out_proj,
                            &l.ffn.router, &l.ffn.shared_gate})
      check(*x);
    for (const Matrix& x : l.lin.in_proj.stored) check(x);
    check_ffn(l.ffn.shared);
    check_ffn(l.ffn.dense);
  }
  if (other)
    return std::string("weights stored as ") + dtype_name(*other) +
           " need --device cpu (the CUDA backend reads bf16, f16 and f32)";
  return "";
}

std::unique_ptr<CudaModel> place_model(const ModelOptions& opt, const QwenModel& host) {
  if (opt.device == "cpu") {
    if (!opt.cpu_note.empty()) note_cpu(opt.cpu_note);
    return nullptr;
  }
  std::string obstacle = cuda_obstacle(host);
  if (opt.device == "cuda") {
    std::string why;
    if (!CudaModel::available(&why)) fail(device_words(opt) + ": no usable GPU (" + why + "); use --device cpu");
    if (!obstacle.empty()) fail(device_words(opt) + ": " + obstacle);
    return CudaModel::upload(host, opt.cuda);
  }
  // auto, with a usable GPU: the GPU unless the weights keep this run off
  // it or the upload fails (out of device memory, an unsupported shape);
  // the host model is loaded either way, so the CPU can take over.
  if (obstacle.empty()) {
    try {
      return CudaModel::upload(host, opt.cuda);
    } catch (const Error& e) {
      obstacle = "the GPU could not take this model (" + without_advice(e.what()) + ")";
    }
  }
  note_cpu(obstacle + (opt.gpu_expert_cache.empty() ? "" : "; --gpu-expert-cache is ignored"));
  return nullptr;
}

}  // namespace flashmoe::cli
