#include "model/qwen_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "format/model_files.h"
#include "experts/manifest.h"
#include "model/blocks.h"
#include "model/open_store.h"

namespace flashmoe {

namespace {
// Prompts are processed in chunks of this many tokens: enough to amortise
// weight reads across tokens, small enough to bound activation memory.
constexpr int64_t kPrefillChunk = 256;
}  // namespace

QwenModel::QwenModel(const std::string& dir, const ExpertOptions& experts)
    : cfg_(load_model_config(dir)), ck_(dir) {
  w_ = load_weights(ck_, cfg_, /*with_experts=*/!is_packed_dir(dir));
  store_ = open_expert_store(dir, cfg_, ck_, w_, experts);
  const int64_t rd = cfg_.rotary_dim;
  // HF casts the inv_freq buffer along with the weights when a model is
  // loaded in its checkpoint dtype, so a bf16 checkpoint rotates with
  // bf16-rounded frequencies; reproduce that (it shifts logits by ~1e-3).
  for (int64_t i = 0; i < rd / 2; ++i) {
    float f = float(1.0 / std::pow(cfg_.rope_theta, double(2 * i) / double(rd)));
    if (cfg_.torch_dtype == "bfloat16") f = bf16_to_f32(f32_to_bf16(f));
    else if (cfg_.torch_dtype == "float16") f = f16_to_f32(f32_to_f16(f));
    inv_freq_.push_back(f);
  }
  int full = 0, lin = 0;
  for (auto k : cfg_.layer_kinds) layer_slot_.push_back(k == LayerKind::Full ? full++ : lin++);
}

std::unique_ptr<QwenModel> QwenModel::load(const std::string& dir, const ExpertOptions& experts) {
  return std::unique_ptr<QwenModel>(new QwenModel(resolve_model_files(dir).model_dir, experts));
}

ModelState QwenModel::new_state(const KvConfig& kv) const {
  kv.validate();
  ModelState st;
  const int64_t conv_dim = cfg_.lin_conv_dim();
  for (auto k : cfg_.layer_kinds) {
    if (k == LayerKind::Full) {
      st.kv.emplace_back(cfg_.num_kv_heads, cfg_.head_dim, kv);
    } else {
      st.conv.emplace_back(size_t(conv_dim * (cfg_.conv_kernel - 1)), 0.0f);
      st.ssm.emplace_back(size_t(cfg_.lin_num_v_heads * cfg_.lin_k_dim * cfg_.lin_v_dim), 0.0f);
    }
  }
  return st;
}

void QwenModel::forward(ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode,
                        float* logits, ThreadPool& pool) const {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= cfg_.vocab_size)
      fail("token id " + std::to_string(ids[i]) + " is out of range: the vocabulary has " +
           std::to_string(cfg_.vocab_size) + " tokens (0.." + std::to_string(cfg_.vocab_size - 1) + ")");
  if (capture_) hidden_.assign(size_t(cfg_.num_layers + 1), {});
  for (int64_t b = 0; b < n; b += kPrefillChunk) {
    int64_t m = std::min(kPrefillChunk, n - b);
    bool last_chunk = b + m == n;
    LogitsMode cm = mode == LogitsMode::All ? LogitsMode::All : (last_chunk ? mode : LogitsMode::None);
    float* out = mode == LogitsMode::All ? logits + b * cfg_.vocab_size : logits;
    forward_chunk(st, ids + b, m, cm, out, pool);
  }
}

void QwenModel::forward_chunk(ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode,
                              float* logits, ThreadPool& pool) const {
  const int64_t H = cfg_.hidden_size;
  std::vector<float> x(size_t(n * H)), xn(size_t(n * H)), out(size_t(n * H));
  for (int64_t t = 0; t < n; ++t) cpu::load_row(w_.embed, ids[t], x.data() + t * H);
  auto capture = [&](int64_t layer) {
    if (capture_) hidden_[layer].insert(hidden_[layer].end(), x.begin(), x.end());
  };
  capture(0);

  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& lw = w_.layers[l];
    const int slot = layer_slot_[l];
    for (int64_t t = 0; t < n; ++t)
      cpu::rmsnorm_zc(x.data() + t * H, lw.input_norm.data(), H, cfg_.rms_norm_eps, xn.data() + t * H);
    if (lw.kind == LayerKind::Full)
      attention_block(cfg_, lw.attn, inv_freq_.data(), st.kv[slot], st.pos, xn.data(), n, out.data(), pool);
    else
      linear_attention_block(cfg_, lw.lin, st.conv[slot], st.ssm[slot], xn.data(), n, out.data(), pool);
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
    for (int64_t t = 0; t < n; ++t)
      cpu::rmsnorm_zc(x.data() + t * H, lw.post_norm.data(), H, cfg_.rms_norm_eps, xn.data() + t * H);
    ffn_block(cfg_, lw.ffn, *store_, l, xn.data(), n, out.data(), pool);
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
    capture(l + 1);
  }
  st.pos += n;
  store_->note_tokens(n);

  if (mode == LogitsMode::None) return;
  const int64_t first = mode == LogitsMode::All ? 0 : n - 1;
  const int64_t rows = n - first;
  for (int64_t t = first; t < n; ++t)
    cpu::rmsnorm_zc(x.data() + t * H, w_.final_norm.data(), H, cfg_.rms_norm_eps, xn.data() + (t - first) * H);
  cpu::matmul(pool, w_.lm_head, xn.data(), rows, logits);
}

}  // namespace flashmoe
