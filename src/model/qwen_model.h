// The Qwen3.5 / Qwen3-Next hybrid forward pass: GatedDeltaNet and gated
// full-attention mixers, MoE (routed + shared experts) or dense SwiGLU FFNs.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "experts/expert_store.h"
#include "format/checkpoint.h"
#include "format/config.h"
#include "kv/kv_config.h"
#include "model/model_state.h"
#include "model/weights.h"

namespace flashmoe {

enum class LogitsMode { None, Last, All };

class QwenModel {
 public:
  // Loads config.json and the safetensors of an HF model directory (or of
  // the model/ folder of a bundle, see format/model_files.h), or a
  // directory written by `flashmoe pack` (recognised by its manifest).
  static std::unique_ptr<QwenModel> load(const std::string& dir, const ExpertOptions& experts = {});

  const ModelConfig& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  ExpertStore& expert_store() const { return *store_; }

  ModelState new_state(const KvConfig& kv) const;

  // Feeds n tokens, advancing `st`. With LogitsMode::All, logits receives
  // [n, vocab]; with Last, [vocab] for the last token. Throws Error for an id
  // outside the vocabulary before touching the state.
  void forward(ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
               ThreadPool& pool) const;

  // Debug aid: residual stream after each layer for the last forward call's
  // tokens ([L+1][n][H]), collected when enabled.
  void set_capture_hidden(bool on) const { capture_ = on; }
  const std::vector<std::vector<float>>& captured_hidden() const { return hidden_; }

 private:
  QwenModel(const std::string& dir, const ExpertOptions& experts);
  void forward_chunk(ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
                     ThreadPool& pool) const;

  ModelConfig cfg_;
  Checkpoint ck_;
  ModelWeights w_;
  std::unique_ptr<ExpertStore> store_;
  std::vector<float> inv_freq_;       // [rotary_dim / 2]
  std::vector<int> layer_slot_;       // index into ModelState::kv or ::ssm per layer
  mutable bool capture_ = false;
  mutable std::vector<std::vector<float>> hidden_;
};

}  // namespace flashmoe
