#include "model/open_store.h"

#include <utility>

#include "core/error.h"
#include "experts/manifest.h"
#include "experts/memory_store.h"
#include "experts/streaming_store.h"

namespace flashmoe {

namespace {
std::unique_ptr<ExpertStore> weights_store(const ModelWeights& w) {
  uint64_t eb = 0;
  for (const auto& l : w.layers)
    if (!l.ffn.experts.empty()) {
      const FfnExpert& e = l.ffn.experts[0];
      eb = e.gate.nbytes() + e.up.nbytes() + e.down.nbytes();
      break;
    }
  LayerExpertViews layers;
  for (const auto& l : w.layers) layers.push_back(&l.ffn.experts);
  return make_weights_store(std::move(layers), eb);
}
}  // namespace

std::unique_ptr<ExpertStore> open_gguf_expert_store(const GgufModel& g, const ModelConfig& cfg, const ModelWeights& w,
                                                    const ExpertOptions& opt) {
  if (opt.store != "auto" && opt.store != "mmap" && opt.store != "stream")
    fail("--expert-store: unknown store '" + opt.store + "' (expected auto, mmap or stream)");
  if (opt.store == "stream")
    fail(g.path() + ": streaming experts needs a packed model, and `flashmoe pack` does not read GGUF files yet");
  check_in_memory_fits(cfg, g.total_bytes(), opt);
  return weights_store(w);
}

std::unique_ptr<ExpertStore> open_expert_store(const std::string& dir, const ModelConfig& cfg, const Checkpoint& ck,
                                               const ModelWeights& w, const ExpertOptions& opt) {
  if (opt.store != "auto" && opt.store != "mmap" && opt.store != "stream")
    fail("--expert-store: unknown store '" + opt.store + "' (expected auto, mmap or stream)");
  if (!is_packed_dir(dir)) {
    if (opt.store == "stream")
      fail(dir + ": streaming experts needs a packed model; run `flashmoe pack -m " + dir + " -o OUT_DIR` first");
    check_in_memory_fits(cfg, uint64_t(ck.total_bytes()), opt);
    return weights_store(w);
  }
  PackedManifest m = read_manifest(dir, cfg);
  if (opt.store == "mmap") {
    check_in_memory_fits(cfg, uint64_t(ck.total_bytes()) + m.total_expert_bytes(), opt);
    return make_mmap_packed_store(m);
  }
  const uint64_t slot = align_up(m.layout.bytes, kExpertAlign);
  const uint64_t all = slot * cfg.num_experts * m.layers.size();
  MemoryPlan plan = plan_streaming_memory(cfg, uint64_t(ck.total_bytes()), slot, all, opt);
  return make_streaming_store(m, plan.cache, opt.policy, opt.io_threads, opt.direct_io);
}

}  // namespace flashmoe
