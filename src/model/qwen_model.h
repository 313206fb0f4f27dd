// A loaded Qwen3.5 / Qwen3-Next hybrid model: its config, weights, routed
// expert store and layer plan. The forward passes live in the backends
// (backend/cpu/forward.h, backend/cuda/), which walk plan().
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "experts/expert_store.h"
#include "format/checkpoint.h"
#include "format/config.h"
#include "format/gguf.h"
#include "kv/kv_config.h"
#include "model/logits_mode.h"
#include "model/model_state.h"
#include "model/plan.h"
#include "model/weights.h"

namespace flashmoe {

class QwenModel {
 public:
  // Loads config.json and the safetensors of an HF model directory (or of
  // the model/ folder of a bundle, see format/model_files.h), a
  // directory written by `flashmoe pack` (recognised by its manifest), or a
  // .gguf file (the first part of a split one).
  static std::unique_ptr<QwenModel> load(const std::string& dir, const ExpertOptions& experts = {});

  // A model built in memory, with no checkpoint (bench --synthetic on the
  // CPU): `w`'s matrices point into `storage`, which the model keeps alive;
  // the routed experts are w's FfnWeights::experts, served in memory.
  static std::unique_ptr<QwenModel> from_memory(ModelConfig cfg, ModelWeights w, std::shared_ptr<const void> storage);

  const ModelConfig& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  ExpertStore& expert_store() const { return *store_; }
  // The MTP head's routed experts (layer 0), when it has any; null otherwise.
  ExpertStore* mtp_expert_store() const { return mtp_store_.get(); }
  // The layer sequence, made once at load (model/arch/*).
  const ModelPlan& plan() const { return plan_; }

  // An empty state: a KV cache per GatedAttention layer and a conv/recurrent
  // state per GatedDeltaNet layer, indexed by LayerPlan::state_slot.
  // drafting: also the MTP head's KV cache (ModelState::drafting); Error
  // when the model has no MTP head.
  ModelState new_state(const KvConfig& kv, bool drafting = false) const;

 private:
  QwenModel(const std::string& dir, const ExpertOptions& experts);
  QwenModel(ModelConfig cfg, ModelWeights w, std::shared_ptr<const void> storage);

  ModelConfig cfg_;
  std::optional<Checkpoint> ck_;  // an HF / packed directory
  std::unique_ptr<GgufModel> gguf_;  // a GGUF file
  std::shared_ptr<const void> storage_;
  ModelWeights w_;
  std::unique_ptr<ExpertStore> store_, mtp_store_;
  void plan_mtp();
  ModelPlan plan_;
};

}  // namespace flashmoe
