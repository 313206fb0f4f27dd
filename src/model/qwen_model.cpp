#include "model/qwen_model.h"

#include "core/error.h"
#include "experts/manifest.h"
#include "experts/memory_store.h"
#include "format/gguf_config.h"
#include "format/model_files.h"
#include "model/gguf_weights.h"
#include "model/open_store.h"

namespace flashmoe {

QwenModel::QwenModel(const std::string& dir, const ExpertOptions& experts) {
  if (is_gguf_path(dir)) {
    gguf_ = std::make_unique<GgufModel>(dir);
    cfg_ = gguf_model_config(*gguf_);
    if (experts.experts_per_token > 0) limit_experts_per_token(&cfg_, experts.experts_per_token);
    w_ = load_gguf_weights(*gguf_, cfg_);
    store_ = open_gguf_expert_store(*gguf_, cfg_, w_, experts);
  } else {
    cfg_ = load_model_config(dir);
    // Before the store is opened: its memory budget counts one token's experts.
    if (experts.experts_per_token > 0) limit_experts_per_token(&cfg_, experts.experts_per_token);
    ck_.emplace(dir);
    w_ = load_weights(*ck_, cfg_, /*with_experts=*/!is_packed_dir(dir));
    store_ = open_expert_store(dir, cfg_, *ck_, w_, experts);
  }
  plan_ = make_plan(cfg_);
  plan_mtp();
}

void QwenModel::plan_mtp() {
  if (!w_.mtp) return;
  const FfnWeights& f = w_.mtp->layer.ffn;
  plan_.mtp = make_mtp_layer_plan(cfg_, f.moe);
  if (!f.moe) return;
  const FfnExpert& e = f.experts.at(0);
  mtp_store_ = make_weights_store({&f.experts}, uint64_t(e.gate.nbytes() + e.up.nbytes() + e.down.nbytes()));
}

QwenModel::QwenModel(ModelConfig cfg, ModelWeights w, std::shared_ptr<const void> storage)
    : cfg_(std::move(cfg)), storage_(std::move(storage)), w_(std::move(w)) {
  uint64_t eb = 0;
  LayerExpertViews layers;
  for (const LayerWeights& l : w_.layers) {
    layers.push_back(&l.ffn.experts);
    if (eb == 0 && !l.ffn.experts.empty()) {
      const FfnExpert& e = l.ffn.experts[0];
      eb = e.gate.nbytes() + e.up.nbytes() + e.down.nbytes() + 2 * (e.gate.scale_bytes() + e.up.scale_bytes() + e.down.scale_bytes()) +
           e.gate.block_scale_bytes() + e.up.block_scale_bytes() + e.down.block_scale_bytes();
    }
  }
  store_ = make_weights_store(std::move(layers), eb);
  plan_ = make_plan(cfg_);
  plan_mtp();
}

std::unique_ptr<QwenModel> QwenModel::from_memory(ModelConfig cfg, ModelWeights w, std::shared_ptr<const void> storage) {
  return std::unique_ptr<QwenModel>(new QwenModel(std::move(cfg), std::move(w), std::move(storage)));
}

std::unique_ptr<QwenModel> QwenModel::load(const std::string& dir, const ExpertOptions& experts) {
  return std::unique_ptr<QwenModel>(new QwenModel(resolve_model_files(dir).model_dir, experts));
}

ModelState QwenModel::new_state(const KvConfig& kv, bool drafting) const {
  kv.validate();
  ModelState st;
  if (drafting) {
    if (!plan_.mtp) fail("--mtp: the model has no MTP head (no mtp.* tensors in its checkpoint)");
    st.drafting = true;
    st.mtp_kv.emplace_back(cfg_.num_kv_heads, cfg_.head_dim, kv);
  }
  const int64_t conv_dim = cfg_.lin_conv_dim();
  // Layers of one mixer kind come in state_slot order, so push_back gives
  // each its slot.
  for (const LayerPlan& l : plan_.layers) {
    switch (l.mixer) {
      case MixerKind::GatedAttention:
        st.kv.emplace_back(cfg_.num_kv_heads, cfg_.head_dim, kv);
        break;
      case MixerKind::GatedDeltaNet:
        st.conv.emplace_back(size_t(conv_dim * (cfg_.conv_kernel - 1)), 0.0f);
        st.ssm.emplace_back(size_t(cfg_.lin_num_v_heads * cfg_.lin_k_dim * cfg_.lin_v_dim), 0.0f);
        break;
    }
  }
  return st;
}

}  // namespace flashmoe
