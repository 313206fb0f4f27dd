#include "cli/common.h"

#include <cerrno>
#include <cstdlib>

#include "cli/kv_options.h"
#include "core/error.h"

namespace flashmoe::cli {

void add_model_options(CLI::App* cmd, ModelOptions* opt, bool require_model) {
  auto* m = cmd->add_option("-m,--model", opt->model_dir, "Model directory (config.json + safetensors)");
  if (require_model) m->required();
  cmd->add_option("-t,--threads", opt->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--device", opt->device, "Where the forward pass runs: cpu (default) or cuda (GPU 0)")
      ->type_name("cpu|cuda");
  add_kv_options(cmd, &opt->kv);
}

void finalize_model_options(ModelOptions* opt) {
  if (opt->device != "cpu" && opt->device != "cuda")
    fail("--device: '" + opt->device + "' is not a device (expected cpu or cuda)");
  finalize_kv_options(&opt->kv);
}

LoadedModel load_model(const ModelOptions& opt) {
  LoadedModel m;
  m.host = QwenModel::load(opt.model_dir);
  if (opt.device == "cuda") {
    std::string why;
    if (!CudaModel::available(&why)) fail("--device cuda: no usable GPU (" + why + "); use --device cpu");
    m.cuda = CudaModel::upload(*m.host);
  }
  return m;
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    char* end = nullptr;
    errno = 0;
    long long v = item.empty() ? 0 : std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno == ERANGE || v < INT32_MIN || v > INT32_MAX)
      fail("--ids: '" + item + "' is not a token id (expected comma-separated integers like 1,2,3)");
    ids.push_back(int32_t(v));
    i = j + 1;
  }
  if (ids.empty()) fail("--ids: no token ids given");
  return ids;
}

}  // namespace flashmoe::cli
