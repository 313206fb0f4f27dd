#include "model/pack_model.h"

#include "core/error.h"
#include "core/mapped_file.h"
#include "experts/manifest.h"
#include "format/checkpoint.h"
#include "format/config.h"
#include "model/weights.h"

namespace flashmoe {

void pack_model(const std::string& in, const std::string& out, const PackOptions& opt, const PackProgress& progress) {
  if (!is_directory(in)) fail("model directory not found: " + in);
  if (is_packed_dir(in)) fail(in + " is already a packed model (it has " + kManifestName + ")");
  if (file_exists(out) || is_directory(out)) fail("output " + out + " already exists; remove it or choose another -o");
  const ModelConfig cfg = load_model_config(in);
  if (cfg.num_experts == 0) fail(in + ": model has no MoE layers; there are no experts to pack");
  const Checkpoint ck(in);
  const ModelWeights w = load_weights(ck, cfg);
  const LayerExperts experts = [&w](int64_t layer) -> const std::vector<FfnExpert>& {
    return w.layers[layer].ffn.experts;
  };
  write_packed_model(in, ck, cfg, experts, out, opt, progress);
}

}  // namespace flashmoe
