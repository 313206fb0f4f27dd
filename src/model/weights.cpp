#include "model/weights.h"

#include <algorithm>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"

namespace flashmoe {

namespace {

std::string L(int64_t i) { return "layers." + std::to_string(i) + "."; }

FfnExpert load_mlp(const Checkpoint& ck, const std::string& p, int64_t H, int64_t I) {
  return FfnExpert{ck.matrix(p + "gate_proj.weight", I, H), ck.matrix(p + "up_proj.weight", I, H),
                   ck.matrix(p + "down_proj.weight", H, I)};
}

void load_experts(const Checkpoint& ck, const std::string& p, const ModelConfig& c, FfnWeights* f) {
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate;
  if (ck.has(p + "switch_mlp.gate_proj.weight")) {
    // mlx-lm's SwitchGLU: gate, up [E, I, H] and down [E, H, I], each stacked
    // over the experts (and quantised as one module).
    Matrix g = ck.stacked_matrix(p + "switch_mlp.gate_proj.weight", E, I, H);
    Matrix u = ck.stacked_matrix(p + "switch_mlp.up_proj.weight", E, I, H);
    Matrix d = ck.stacked_matrix(p + "switch_mlp.down_proj.weight", E, H, I);
    for (int64_t e = 0; e < E; ++e) f->experts.push_back({g.slice_rows(e * I, I), u.slice_rows(e * I, I), d.slice_rows(e * H, H)});
  } else if (ck.has(p + "experts.gate_up_proj")) {
    // Fused layout of published checkpoints: gate_up [E, 2I, H], down [E, H, I]
    // (FP8 releases: with `_scale_inv` blocks beside each).
    Matrix gum = ck.stacked_matrix(p + "experts.gate_up_proj", E, 2 * I, H);
    Matrix dnm = ck.stacked_matrix(p + "experts.down_proj", E, H, I);
    for (int64_t e = 0; e < E; ++e)
      f->experts.push_back({gum.slice_rows(e * 2 * I, I), gum.slice_rows(e * 2 * I + I, I), dnm.slice_rows(e * H, H)});
  } else {
    for (int64_t e = 0; e < E; ++e) f->experts.push_back(load_mlp(ck, p + "experts." + std::to_string(e) + ".", H, I));
  }
}

// Every tensor config.json implies has been checked above; the reverse check
// catches a config.json that describes less than the checkpoint holds
// (fewer layers, no shared expert, a dense layer where the weights are MoE):
// such a model would load, silently skip those weights and produce fluent
// garbage.
void check_all_used(const Checkpoint& ck, const ModelConfig& c, bool with_experts) {
  std::vector<std::string> unused;
  for (const std::string& n : ck.unused_tensors())
    if (with_experts || (n.find(".mlp.experts.") == std::string::npos && n.find(".mlp.switch_mlp.") == std::string::npos))
      unused.push_back(n);
  if (unused.empty()) return;
  const std::string& first = unused.front();
  const std::string more =
      unused.size() > 1 ? " (and " + std::to_string(unused.size() - 1) + " more tensors)" : std::string();
  std::string why, hint;  // why: config.json is certainly wrong; hint: it may be
  const std::string lp = ck.prefix() + "layers.";
  if (first.compare(0, lp.size(), lp) == 0) {
    const int64_t layer = std::atoll(first.c_str() + lp.size());
    if (layer >= c.num_layers)
      why = "the checkpoint has layer " + std::to_string(layer) + " but config.json says num_hidden_layers " +
            std::to_string(c.num_layers);
    else if (first.find(".shared_expert") != std::string::npos && c.shared_intermediate == 0)
      why = "the checkpoint has a shared expert but config.json has no shared_expert_intermediate_size";
    else if (first.find(".mlp.") != std::string::npos)
      hint = "config.json makes layer " + std::to_string(layer) + (c.layer_is_moe[layer] ? " an MoE" : " a dense") +
             " layer (num_experts, mlp_only_layers, decoder_sparse_step)";
    else
      hint = "config.json makes layer " + std::to_string(layer) +
             (c.layer_kinds[layer] == LayerKind::Full ? " full attention" : " linear attention") + " (layer_types)";
  }
  const std::string msg = ck.dir() + ": config.json does not match the checkpoint: tensor '" + first + "'" + more +
                          " is not used by the model config.json describes";
  // A structural disagreement is an error; other extra tensors (a layout
  // this loader does not know) only warn, so an unfamiliar but valid
  // checkpoint still loads.
  if (!why.empty()) fail(msg + ": " + why);
  std::fprintf(stderr, "flashmoe: warning: %s%s; they are ignored\n", msg.c_str(), hint.empty() ? "" : (" (" + hint + ")").c_str());
}

// mlx-lm converts an HF checkpoint in one step (its sanitize()): the conv
// taps become [C, K, 1] (MLX's channels-last Conv1d) and the zero-centred
// norms (input, post-attention, final, q, k) are stored as 1 + w, since
// MLX's RMSNorm scales by w. The conv's shape tells such a checkpoint
// apart; the norms are shifted back at load (exact in fp32).
bool is_mlx_lm(const Checkpoint& ck, const ModelConfig& c) {
  const int64_t conv_dim = c.lin_conv_dim(), K = c.conv_kernel;
  for (int64_t i = 0; i < c.num_layers; ++i)
    if (c.layer_kinds[size_t(i)] == LayerKind::Linear && ck.has(L(i) + "linear_attn.conv1d.weight"))
      return ck.get(L(i) + "linear_attn.conv1d.weight").shape == std::vector<int64_t>{conv_dim, K, 1} && K != 1;
  return false;
}

// A zero-centred norm weight (stored as 1 + w by mlx-lm).
std::vector<float> load_norm(const Checkpoint& ck, const std::string& name, int64_t n, bool mlx_lm) {
  std::vector<float> v = ck.vector_f32(name, {n});
  if (mlx_lm)
    for (float& x : v) x -= 1.0f;
  return v;
}

// One decoder layer under `p` ("layers.3.", "/mtp.layers.0."): its mixer
// (`kind`) and its feed-forward (routed experts when `moe`).
LayerWeights load_layer(const Checkpoint& ck, const ModelConfig& c, const std::string& p, LayerKind kind, bool moe,
                        bool with_experts, bool mlx_lm) {
  const int64_t H = c.hidden_size;
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int64_t nk = c.lin_num_k_heads, nv = c.lin_num_v_heads, dk = c.lin_k_dim, dv = c.lin_v_dim;
  const int64_t conv_dim = c.lin_conv_dim(), K = c.conv_kernel;
  auto norm = [&](const std::string& name, int64_t n) { return load_norm(ck, name, n, mlx_lm); };
  LayerWeights lw;
  lw.kind = kind;
  lw.input_norm = norm(p + "input_layernorm.weight", H);
  lw.post_norm = norm(p + "post_attention_layernorm.weight", H);
  if (lw.kind == LayerKind::Full) {
    const std::string a = p + "self_attn.";
    lw.attn.q_proj = ck.matrix(a + "q_proj.weight", 2 * nh * hd, H);
    lw.attn.k_proj = ck.matrix(a + "k_proj.weight", nkv * hd, H);
    lw.attn.v_proj = ck.matrix(a + "v_proj.weight", nkv * hd, H);
    lw.attn.o_proj = ck.matrix(a + "o_proj.weight", H, nh * hd);
    lw.attn.q_norm = norm(a + "q_norm.weight", hd);
    lw.attn.k_norm = norm(a + "k_norm.weight", hd);
  } else {
    const std::string a = p + "linear_attn.";
    LinearAttentionWeights& l = lw.lin;
    SplitProjection& in = l.in_proj;
    if (c.family == Family::Qwen3Next || ck.has(a + "in_proj_qkvz.weight")) {
      // Per key head g: [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)] and [b_g (r), a_g (r)].
      in.stored = {ck.matrix(a + "in_proj_qkvz.weight", 2 * nk * dk + 2 * nv * dv, H),
                   ck.matrix(a + "in_proj_ba.weight", 2 * nv, H)};
      const int64_t r = nv / nk, group = 2 * dk + 2 * r * dv;
      const int64_t qkvz_at[4] = {0, dk, 2 * dk, 2 * dk + r * dv}, qkvz_len[4] = {dk, dk, r * dv, r * dv};
      for (int part = 0; part < 4; ++part)
        for (int64_t g = 0; g < nk; ++g) in.blocks.push_back({0, g * group + qkvz_at[part], qkvz_len[part]});
      for (int part = 0; part < 2; ++part)
        for (int64_t g = 0; g < nk; ++g) in.blocks.push_back({1, g * 2 * r + part * r, r});
    } else {
      in.stored = {ck.matrix(a + "in_proj_qkv.weight", conv_dim, H), ck.matrix(a + "in_proj_z.weight", nv * dv, H),
                   ck.matrix(a + "in_proj_b.weight", nv, H), ck.matrix(a + "in_proj_a.weight", nv, H)};
      for (int i = 0; i < 4; ++i) in.blocks.push_back({i, 0, in.stored[size_t(i)].rows});
    }
    // [C, 1, K] (HF) and [C, K, 1] (mlx-lm) hold the taps in the same order.
    l.conv = ck.vector_f32(a + "conv1d.weight", mlx_lm ? std::vector<int64_t>{conv_dim, K, 1} : std::vector<int64_t>{conv_dim, 1, K});
    l.dt_bias = ck.vector_f32(a + "dt_bias", {nv});
    std::vector<float> a_log = ck.vector_f32(a + "A_log", {nv});
    for (float x : a_log) l.neg_exp_A.push_back(-std::exp(x));
    l.norm = ck.vector_f32(a + "norm.weight", {dv});
    l.out_proj = ck.matrix(a + "out_proj.weight", H, nv * dv);
  }
  const std::string m = p + "mlp.";
  if (moe) {
    lw.ffn.moe = true;
    lw.ffn.router = ck.matrix(m + "gate.weight", c.num_experts, H);
    if (with_experts) load_experts(ck, m, c, &lw.ffn);
    if (c.shared_intermediate > 0) {
      lw.ffn.has_shared = true;
      lw.ffn.shared = load_mlp(ck, m + "shared_expert.", H, c.shared_intermediate);
      lw.ffn.shared_gate = ck.matrix(m + "shared_expert_gate.weight", 1, H);
    }
  } else {
    lw.ffn.dense = load_mlp(ck, m, H, c.intermediate_size);
  }
  return lw;
}

// The MTP head, when the checkpoint has one: `mtp.*` beside the text model
// (HF's Qwen3-Next and Qwen3.5 checkpoints, wrapper or not) or under its
// prefix (some conversions). Its experts come from the checkpoint itself
// (fused or per expert), also for a packed model, whose expert store holds
// only the main layers; a packed directory without them has no head.
std::optional<MtpWeights> load_mtp(const Checkpoint& ck, const ModelConfig& c, bool with_experts) {
  std::string m;
  if (ck.has("/mtp.fc.weight")) m = "/mtp.";
  else if (ck.has("mtp.fc.weight")) m = "mtp.";
  else return std::nullopt;
  const std::string lp = m + "layers.0.";
  const bool moe = ck.has(lp + "mlp.gate.weight");
  if (moe && !with_experts && !ck.has(lp + "mlp.experts.gate_up_proj") && !ck.has(lp + "mlp.experts.0.gate_proj.weight"))
    return std::nullopt;
  const int64_t H = c.hidden_size;
  MtpWeights w;
  w.fc = ck.matrix(m + "fc.weight", H, 2 * H);
  w.norm_embedding = ck.vector_f32(m + "pre_fc_norm_embedding.weight", {H});
  w.norm_hidden = ck.vector_f32(m + "pre_fc_norm_hidden.weight", {H});
  w.final_norm = ck.vector_f32(m + "norm.weight", {H});
  w.layer = load_layer(ck, c, lp, LayerKind::Full, moe, /*with_experts=*/true, /*mlx_lm=*/false);
  return w;
}

}  // namespace

int64_t SplitProjection::rows() const {
  int64_t n = 0;
  for (const Block& b : blocks) n += b.rows;
  return n;
}

std::vector<Matrix> SplitProjection::block_views() const {
  std::vector<Matrix> v;
  for (const Block& b : blocks) v.push_back(stored[size_t(b.matrix)].slice_rows(b.row0, b.rows));
  return v;
}

void SplitProjection::gather(const float* const* outs, float* y) const {
  for (const Block& b : blocks) {
    const float* src = outs[b.matrix] + b.row0;
    y = std::copy(src, src + b.rows, y);
  }
}

ModelWeights load_weights(const Checkpoint& ck, const ModelConfig& c, bool with_experts) {
  ModelWeights w;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  w.embed = ck.matrix("embed_tokens.weight", V, H);
  if (ck.has(ck.lm_head_name())) w.lm_head = ck.matrix(ck.lm_head_name(), V, H);
  else if (c.tie_word_embeddings) w.lm_head = w.embed;
  else fail(ck.dir() + ": checkpoint has no tensor 'lm_head.weight' and tie_word_embeddings is false");

  const bool mlx_lm = is_mlx_lm(ck, c);
  w.final_norm = load_norm(ck, "norm.weight", H, mlx_lm);
  for (int64_t i = 0; i < c.num_layers; ++i)
    w.layers.push_back(load_layer(ck, c, L(i), c.layer_kinds[size_t(i)], c.layer_is_moe[size_t(i)], with_experts, mlx_lm));
  w.mtp = load_mtp(ck, c, with_experts);
  check_all_used(ck, c, with_experts);
  return w;
}

}  // namespace flashmoe
