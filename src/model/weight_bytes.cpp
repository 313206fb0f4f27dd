#include "model/weight_bytes.h"

namespace flashmoe {

namespace {
// A quantised matrix is read with its bf16 scales and biases.
int64_t matrix_bytes(const Matrix& m) { return int64_t(m.nbytes() + 2 * m.scale_bytes() + m.block_scale_bytes()); }
int64_t mlp_bytes(const FfnExpert& e) { return matrix_bytes(e.gate) + matrix_bytes(e.up) + matrix_bytes(e.down); }
int64_t vec_bytes(const std::vector<float>& v) { return int64_t(v.size() * sizeof(float)); }
}  // namespace

WeightBytes count_weight_bytes(const ModelConfig& cfg, const ModelWeights& w) {
  WeightBytes b;
  int64_t fixed = int64_t(w.lm_head.nbytes()) + vec_bytes(w.final_norm);
  fixed += int64_t(w.embed.row_bytes());  // one row read per token
  int64_t embed_total = w.lm_head.data == w.embed.data ? 0 : int64_t(w.embed.nbytes());
  int64_t routed_per_token = 0;
  for (const LayerWeights& l : w.layers) {
    fixed += vec_bytes(l.input_norm) + vec_bytes(l.post_norm);
    if (l.kind == LayerKind::Full) {
      const AttentionWeights& a = l.attn;
      fixed += int64_t(a.q_proj.nbytes() + a.k_proj.nbytes() + a.v_proj.nbytes() + a.o_proj.nbytes());
      fixed += vec_bytes(a.q_norm) + vec_bytes(a.k_norm);
    } else {
      const LinearAttentionWeights& a = l.lin;
      for (const Matrix& m : a.in_proj.stored) fixed += int64_t(m.nbytes());
      fixed += int64_t(a.out_proj.nbytes());
      fixed += vec_bytes(a.conv) + vec_bytes(a.dt_bias) + vec_bytes(a.neg_exp_A) + vec_bytes(a.norm);
    }
    const FfnWeights& f = l.ffn;
    if (f.moe) {
      fixed += int64_t(f.router.nbytes());
      if (f.has_shared) fixed += mlp_bytes(f.shared) + int64_t(f.shared_gate.nbytes());
      int64_t all = 0;
      for (const FfnExpert& e : f.experts) all += mlp_bytes(e);
      b.experts_total += all;
      if (!f.experts.empty()) routed_per_token += all / int64_t(f.experts.size()) * cfg.num_experts_per_tok;
    } else {
      fixed += mlp_bytes(f.dense);
    }
  }
  b.per_token = fixed + routed_per_token;
  b.total = fixed - int64_t(w.embed.row_bytes()) + embed_total + b.experts_total;
  return b;
}

}  // namespace flashmoe
