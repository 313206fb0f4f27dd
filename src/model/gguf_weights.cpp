#include "model/gguf_weights.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "core/error.h"

namespace flashmoe {

namespace {

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "{";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "}";
}

// Trailing dimensions of 1 carry no information (llama.cpp writes [H, 1] for
// a one-row matrix and [H] for a vector interchangeably).
std::vector<int64_t> squeeze(std::vector<int64_t> ne) {
  while (ne.size() > 1 && ne.back() == 1) ne.pop_back();
  return ne;
}

bool block_kind(uint32_t t, QuantKind* q) {
  switch (GgmlType(t)) {
    case GgmlType::Q8_0: *q = QuantKind::Q8_0; return true;
    case GgmlType::Q4_0: *q = QuantKind::Q4_0; return true;
    case GgmlType::Q4_1: *q = QuantKind::Q4_1; return true;
    case GgmlType::Q5_0: *q = QuantKind::Q5_0; return true;
    case GgmlType::Q5_1: *q = QuantKind::Q5_1; return true;
    case GgmlType::Q4_K: *q = QuantKind::Q4_K; return true;
    case GgmlType::Q5_K: *q = QuantKind::Q5_K; return true;
    case GgmlType::Q6_K: *q = QuantKind::Q6_K; return true;
    case GgmlType::IQ4_NL: *q = QuantKind::IQ4_NL; return true;
    case GgmlType::IQ4_XS: *q = QuantKind::IQ4_XS; return true;
    default: return false;
  }
}

bool float_type(uint32_t t, DType* d) {
  switch (GgmlType(t)) {
    case GgmlType::F32: *d = DType::F32; return true;
    case GgmlType::F16: *d = DType::F16; return true;
    case GgmlType::BF16: *d = DType::BF16; return true;
    default: return false;
  }
}

const char* kSupported = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS";

class Loader {
 public:
  Loader(const GgufModel& g, const ModelConfig& c) : g_(g), c_(c) {}

  const GgufTensor& get(const std::string& name, const std::vector<int64_t>& ne) {
    const GgufTensor* t = g_.tensor(name);
    if (!t) fail(g_.path() + ": GGUF has no tensor '" + name + "', which the model's metadata implies");
    if (squeeze(t->ne) != squeeze(ne))
      fail(g_.path() + ": tensor '" + name + "' has shape " + shape_str(t->ne) + ", expected " + shape_str(ne) +
           " from the metadata");
    used_.insert(name);
    return *t;
  }

  // [rows, cols] stored as ne = {cols, rows, extra...}.
  Matrix matrix(const std::string& name, int64_t rows, int64_t cols, std::vector<int64_t> extra = {}) {
    std::vector<int64_t> ne = {cols, rows};
    ne.insert(ne.end(), extra.begin(), extra.end());
    const GgufTensor& t = get(name, ne);
    int64_t all_rows = rows;
    for (int64_t e : extra) all_rows *= e;
    Matrix m;
    m.data = t.data;
    m.rows = all_rows;
    m.cols = cols;
    if (!block_kind(t.type, &m.quant) && !float_type(t.type, &m.dtype))
      fail(g_.path() + ": tensor '" + name + "' has type " + ggml_type_name(t.type) +
           ", which flashmoe does not support (supported: " + kSupported + ")");
    if (m.block_quantized()) m.dtype = DType::U8;
    return m;
  }

  std::vector<float> vec(const std::string& name, const std::vector<int64_t>& ne, float minus = 0.0f) {
    const GgufTensor& t = get(name, ne);
    DType d;
    if (!float_type(t.type, &d))
      fail(g_.path() + ": tensor '" + name + "' has type " + ggml_type_name(t.type) + "; F32, F16 or BF16 expected");
    std::vector<float> out(size_t(t.numel()));
    for (size_t i = 0; i < out.size(); ++i) {
      float v;
      if (d == DType::F32) std::memcpy(&v, t.data + 4 * i, 4);
      else {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        v = d == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
      out[i] = v - minus;
    }
    return out;
  }

  // llama.cpp's converter stores RMSNorm weights as 1 + w; flashmoe's norm
  // computes x * (1 + w) from the HF w.
  std::vector<float> norm(const std::string& name, int64_t n) { return vec(name, {n}, 1.0f); }

  FfnExpert mlp(const std::string& p, const std::string& suffix, int64_t H, int64_t I) {
    return FfnExpert{matrix(p + "ffn_gate" + suffix + ".weight", I, H), matrix(p + "ffn_up" + suffix + ".weight", I, H),
                     matrix(p + "ffn_down" + suffix + ".weight", H, I)};
  }

  void experts(const std::string& p, FfnWeights* f) {
    const int64_t E = c_.num_experts, H = c_.hidden_size, I = c_.moe_intermediate;
    Matrix gate, up;
    int64_t gate_stride = I, gate0 = 0, up0 = 0;
    if (g_.has_tensor(p + "ffn_gate_up_exps.weight")) {
      // Fused: per expert [gate (I rows) | up (I rows)].
      gate = up = matrix(p + "ffn_gate_up_exps.weight", 2 * I, H, {E});
      gate_stride = 2 * I;
      up0 = I;
    } else {
      gate = matrix(p + "ffn_gate_exps.weight", I, H, {E});
      up = matrix(p + "ffn_up_exps.weight", I, H, {E});
    }
    const Matrix down = matrix(p + "ffn_down_exps.weight", H, I, {E});
    for (int64_t e = 0; e < E; ++e)
      f->experts.push_back({gate.slice_rows(e * gate_stride + gate0, I), up.slice_rows(e * gate_stride + up0, I),
                            down.slice_rows(e * H, H)});
  }

  void check_all_used() const {
    // Tensors of layers past the trunk (multi-token prediction) are skipped
    // on purpose; anything else unused means the metadata describes less
    // than the file holds.
    std::vector<std::string> unused;
    for (const auto& kv : g_.tensors()) {
      const std::string& n = kv.first;
      if (used_.count(n)) continue;
      if (n.compare(0, 4, "blk.") == 0 && std::atoll(n.c_str() + 4) >= c_.num_layers) continue;
      unused.push_back(n);
    }
    if (unused.empty()) return;
    std::fprintf(stderr, "flashmoe: warning: %s: tensor '%s'%s not used by the model the metadata describes; ignored\n",
                 g_.path().c_str(), unused[0].c_str(),
                 unused.size() > 1 ? (" (and " + std::to_string(unused.size() - 1) + " more) are").c_str() : " is");
  }

 private:
  const GgufModel& g_;
  const ModelConfig& c_;
  std::set<std::string> used_;
};

}  // namespace

ModelWeights load_gguf_weights(const GgufModel& g, const ModelConfig& c) {
  Loader ld(g, c);
  ModelWeights w;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  w.embed = ld.matrix("token_embd.weight", V, H);
  w.lm_head = g.has_tensor("output.weight") ? ld.matrix("output.weight", V, H) : w.embed;
  w.final_norm = ld.norm("output_norm.weight", H);

  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int64_t nk = c.lin_num_k_heads, nv = c.lin_num_v_heads, dv = c.lin_v_dim;
  const int64_t conv_dim = c.lin_conv_dim(), K = c.conv_kernel, r = nv / nk;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights lw;
    const std::string p = "blk." + std::to_string(i) + ".";
    lw.kind = c.layer_kinds[size_t(i)];
    lw.input_norm = ld.norm(p + "attn_norm.weight", H);
    lw.post_norm = ld.norm(p + "post_attention_norm.weight", H);
    if (lw.kind == LayerKind::Full) {
      AttentionWeights& at = lw.attn;
      if (g.has_tensor(p + "attn_qkv.weight")) {
        const Matrix qkv = ld.matrix(p + "attn_qkv.weight", 2 * nh * hd + 2 * nkv * hd, H);
        at.q_proj = qkv.slice_rows(0, 2 * nh * hd);
        at.k_proj = qkv.slice_rows(2 * nh * hd, nkv * hd);
        at.v_proj = qkv.slice_rows(2 * nh * hd + nkv * hd, nkv * hd);
      } else {
        at.q_proj = ld.matrix(p + "attn_q.weight", 2 * nh * hd, H);
        at.k_proj = ld.matrix(p + "attn_k.weight", nkv * hd, H);
        at.v_proj = ld.matrix(p + "attn_v.weight", nkv * hd, H);
      }
      at.o_proj = ld.matrix(p + "attn_output.weight", H, nh * hd);
      at.q_norm = ld.norm(p + "attn_q_norm.weight", hd);
      at.k_norm = ld.norm(p + "attn_k_norm.weight", hd);
    } else {
      LinearAttentionWeights& l = lw.lin;
      SplitProjection& in = l.in_proj;
      in.stored = {ld.matrix(p + "attn_qkv.weight", conv_dim, H), ld.matrix(p + "attn_gate.weight", nv * dv, H)};
      in.blocks = {{0, 0, conv_dim}, {1, 0, nv * dv}};
      if (c.family == Family::Qwen3Next) {
        // ssm_ba keeps HF's grouping: per key head g, [b_g (r) | a_g (r)].
        in.stored.push_back(ld.matrix(p + "ssm_ba.weight", 2 * nv, H));
        for (int part = 0; part < 2; ++part)
          for (int64_t g2 = 0; g2 < nk; ++g2) in.blocks.push_back({2, g2 * 2 * r + part * r, r});
      } else {
        in.stored.push_back(ld.matrix(p + "ssm_beta.weight", nv, H));
        in.stored.push_back(ld.matrix(p + "ssm_alpha.weight", nv, H));
        in.blocks.push_back({2, 0, nv});
        in.blocks.push_back({3, 0, nv});
        // The converter reorders Qwen3.5's value heads to tiled order when
        // there are more value than key heads.
        l.v_heads_tiled = nk != nv;
      }
      l.conv = ld.vec(p + "ssm_conv1d.weight", {K, conv_dim});
      l.dt_bias = ld.vec(p + "ssm_dt.bias", {nv});
      l.neg_exp_A = ld.vec(p + "ssm_a", {nv});
      l.norm = ld.vec(p + "ssm_norm.weight", {dv});
      l.out_proj = ld.matrix(p + "ssm_out.weight", H, nv * dv);
    }
    if (c.layer_is_moe[size_t(i)]) {
      FfnWeights& f = lw.ffn;
      f.moe = true;
      f.router = ld.matrix(p + "ffn_gate_inp.weight", c.num_experts, H);
      ld.experts(p, &f);
      if (c.shared_intermediate > 0) {
        f.has_shared = true;
        f.shared = ld.mlp(p, "_shexp", H, c.shared_intermediate);
        f.shared_gate = ld.matrix(p + "ffn_gate_inp_shexp.weight", 1, H);
      }
    } else {
      lw.ffn.dense = ld.mlp(p, "", H, c.intermediate_size);
    }
    w.layers.push_back(std::move(lw));
  }
  ld.check_all_used();
  return w;
}

}  // namespace flashmoe
