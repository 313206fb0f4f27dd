// Options shared by the commands that run a model.
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "experts/expert_store.h"
#include "backend/cuda/cuda_model.h"
#include "kv/kv_config.h"
#include "model/qwen_model.h"

namespace flashmoe {
class QwenModel;
}

namespace flashmoe::cli {

struct ModelOptions {
  std::string model_dir;
  int threads = 0;  // 0: all cores
  // --device as given (empty: not given, then FLASHMOE_DEVICE, then auto).
  // After finalize_model_options: "cpu", "cuda", or "auto" (a usable GPU is
  // present and nothing seen so far keeps this run off it; load_model decides).
  std::string device;
  std::string device_source;  // after finalize: "--device", "FLASHMOE_DEVICE" or "" (the default, auto)
  bool device_auto = false;   // after finalize: the device was chosen by auto
  // Set by a command before finalize_model_options when this run uses
  // something only the CPU backend implements (e.g. "--hidden"): auto then
  // picks the CPU, an explicit cuda is an error naming it.
  std::string cpu_only;
  // After finalize, when auto picked the CPU: why (the note load_model prints;
  // empty when there simply is no usable GPU, which needs no note), and
  // no_gpu: why no GPU is usable ("" when one is).
  std::string cpu_note, no_gpu;
  KvConfig kv;
  ExpertOptions experts;
  std::string cache_policy = "lru";
  bool stats = false;  // --stats: print expert-store statistics to stderr
  std::string gpu_expert_cache;  // --gpu-expert-cache: "GB" or "N%" (empty: all experts in VRAM)
  std::string gpu_host_cache;    // --gpu-host-cache: "GB" or "N%" (empty: every expert outside VRAM in host memory)
  CudaOptions cuda;              // parsed from the above by finalize_model_options
};

// Adds -m/--model, -t/--threads, --device, the KV-cache options, the
// expert-store options and --stats to a command.
void add_model_options(CLI::App* cmd, ModelOptions* opt, bool require_model = true);
// Validates what add_model_options parsed and settles the device as far as
// the options allow (cli/device.h); call at the start of the callback,
// after setting ModelOptions::cpu_only if the command needs it.
void finalize_model_options(ModelOptions* opt);

// Prints the expert-store statistics to stderr when --stats was given (with
// a GPU model: the tiered expert cache's counters).
void print_expert_stats(const ModelOptions& opt, const QwenModel& model, const char* label,
                        const CudaModel* cuda = nullptr);
// "vram hits 1234 (56.1%), host 967 (43.9%), ..." for the tiered expert cache.
std::string format_tier_stats(const CudaTierStats& s, int64_t tokens = 0);

// The model of opt.model_dir on the host, and on the GPU when the device is
// cuda, or auto and the GPU can take it (see cli/device.h). An explicit cuda
// that cannot run throws Error naming what failed, with a hint to use
// --device cpu; auto falls back to the CPU with one note line on stderr.
struct LoadedModel {
  std::unique_ptr<QwenModel> host;
  std::unique_ptr<CudaModel> cuda;  // null when the forward pass runs on the CPU
};
LoadedModel load_model(const ModelOptions& opt);

// Parses "1,2,3" into token ids; throws Error naming the bad item.
std::vector<int32_t> parse_ids(const std::string& s);

}  // namespace flashmoe::cli
