#include "model/synthetic_model.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace flashmoe {

namespace {

uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}

// Owns every buffer the synthetic weights point into. A counting arena
// allocates nothing: it sizes the model before any memory is taken.
struct Arena {
  bool counting = false;
  uint64_t bytes = 0;
  std::vector<void*> blocks;
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (void* p : blocks) std::free(p);
  }
  void* alloc(size_t n) {
    bytes += n;
    if (counting) return nullptr;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) fail("bench --synthetic: out of memory allocating " + std::to_string(n >> 20) + " MiB of weights");
    blocks.push_back(p);
    return p;
  }
};

class Builder {
 public:
  Builder(Arena& a, ThreadPool& pool, uint64_t seed) : a_(a), pool_(pool), salt_(seed) {}

  // n values uniform in [-scale, scale) as bf16, filled by the pool's threads
  // (so the pages sit where the threads that read them run).
  uint16_t* bf16(size_t n, float scale) {
    auto* p = static_cast<uint16_t*>(a_.alloc(n * 2));
    if (!p) return p;
    const uint64_t s = ++salt_ * 0x9E3779B97F4A7C15ULL;
    for_chunks(n, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i)
        p[i] = f32_to_bf16((float(hash32(s + i)) * (1.0f / 4294967296.0f) * 2.0f - 1.0f) * scale);
    });
    return p;
  }
  Matrix matrix(int64_t rows, int64_t cols) {
    Matrix m;
    m.dtype = DType::BF16;
    m.rows = rows;
    m.cols = cols;
    m.data = bf16(size_t(rows * cols), 1.0f / std::sqrt(float(cols)));
    return m;
  }
  // Random codes, with scales and biases that spread them over the same
  // range as matrix() (value = code * scale + bias).
  Matrix quantized(int64_t rows, int64_t cols, QuantKind q, int group) {
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.quant = q;
    m.group = group;
    const size_t code_bytes = m.nbytes(), groups = size_t(rows * (cols / group));
    auto* codes = static_cast<uint8_t*>(a_.alloc(code_bytes));
    auto* scales = static_cast<uint16_t*>(a_.alloc(groups * 2));
    auto* biases = static_cast<uint16_t*>(a_.alloc(groups * 2));
    if (!codes) return m;
    const uint64_t s = ++salt_ * 0x9E3779B97F4A7C15ULL;
    for_chunks(code_bytes / 4, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) reinterpret_cast<uint32_t*>(codes)[i] = hash32(s + i);
    });
    const float r = 1.0f / std::sqrt(float(cols)), top = float((1 << quant_bits(q)) - 1);
    for (size_t i = 0; i < groups; ++i) {
      scales[i] = f32_to_bf16(2 * r / top);
      biases[i] = f32_to_bf16(-r);
    }
    m.data = codes;
    m.scales = scales;
    m.biases = biases;
    return m;
  }
  // FP8 blocks of 128 x 128: random E4M3 codes of magnitude below 2 (bit 6
  // clear: exponents 0..7, never the NaN codes), block scales that spread
  // them over about the same range as matrix().
  Matrix fp8(int64_t rows, int64_t cols) {
    constexpr int kBlock = 128;
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.quant = QuantKind::Fp8Block;
    m.group = kBlock;
    m.block_rows = kBlock;
    const size_t code_bytes = m.nbytes(), nscales = m.block_scale_bytes() / 4;
    auto* codes = static_cast<uint8_t*>(a_.alloc((code_bytes + 3) / 4 * 4));
    auto* scales = static_cast<float*>(a_.alloc(nscales * 4));
    if (!codes) return m;
    const uint64_t s = ++salt_ * 0x9E3779B97F4A7C15ULL;
    for_chunks((code_bytes + 3) / 4, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) reinterpret_cast<uint32_t*>(codes)[i] = hash32(s + i) & 0xBFBFBFBFu;
    });
    for (size_t i = 0; i < nscales; ++i) scales[i] = 0.75f / std::sqrt(float(cols));
    m.data = codes;
    m.block_scales = scales;
    return m;
  }

 private:
  template <typename F>
  void for_chunks(size_t n, const F& f) {
    const size_t chunk = size_t(1) << 20;
    pool_.parallel_for(int64_t((n + chunk - 1) / chunk), [&](int64_t c0, int64_t c1) {
      f(size_t(c0) * chunk, std::min(n, size_t(c1) * chunk));
    });
  }

  Arena& a_;
  ThreadPool& pool_;
  uint64_t salt_;
};

}  // namespace

namespace {

// MemAvailable from /proc/meminfo, in bytes (0 where unknown).
uint64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb << 10;
  return 0;
}

ModelWeights build_weights(const ModelConfig& c, QuantKind experts, int group, uint64_t seed, Arena& arena,
                           ThreadPool& pool, bool fp8_weights, bool mtp_head) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const int64_t nv = c.lin_num_v_heads, dv = c.lin_v_dim, C = c.lin_conv_dim(), K = c.conv_kernel;
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int64_t E = c.num_experts, I = c.moe_intermediate, Is = c.shared_intermediate;
  if (experts != QuantKind::None && experts != QuantKind::Fp8Block &&
      (group <= 0 || group % 8 != 0 || H % group != 0 || I % group != 0))
    fail("bench: --group " + std::to_string(group) + " must be a multiple of 8 dividing the hidden size " +
         std::to_string(H) + " and the expert width " + std::to_string(I));
  Builder b(arena, pool, seed);
  // A linear weight an FP8 release converts.
  auto lin = [&](int64_t rows, int64_t cols) { return fp8_weights ? b.fp8(rows, cols) : b.matrix(rows, cols); };
  ModelWeights w;

  w.embed = b.matrix(V, H);
  w.lm_head = w.embed;
  w.final_norm.assign(size_t(H), 0.f);  // Qwen3.5 norms scale by 1 + w
  auto layer = [&](LayerKind kind, bool moe) {
    LayerWeights l;
    l.kind = kind;
    l.input_norm.assign(size_t(H), 0.f);
    l.post_norm.assign(size_t(H), 0.f);
    if (l.kind == LayerKind::Full) {
      l.attn.q_proj = lin(2 * nh * hd, H);
      l.attn.k_proj = lin(nkv * hd, H);
      l.attn.v_proj = lin(nkv * hd, H);
      l.attn.o_proj = lin(H, nh * hd);
      l.attn.q_norm.assign(size_t(hd), 0.f);
      l.attn.k_norm.assign(size_t(hd), 0.f);
    } else {
      // One stored matrix already in output order: q, k, v (the conv
      // channels), z, b, a.
      const Matrix in = lin(C + nv * dv + 2 * nv, H);
      l.lin.in_proj.stored = {in};
      l.lin.in_proj.blocks = {{0, 0, in.rows}};
      l.lin.conv.resize(size_t(C * K));
      for (size_t j = 0; j < l.lin.conv.size(); ++j) l.lin.conv[j] = (float(hash32(seed + j)) / 4294967296.0f - 0.5f);
      l.lin.dt_bias.assign(size_t(nv), 0.f);
      l.lin.neg_exp_A.assign(size_t(nv), -1.f);
      l.lin.norm.assign(size_t(dv), 1.f);  // a plain (not 1 + w) norm
      l.lin.out_proj = lin(H, nv * dv);
    }
    if (moe) {
      l.ffn.moe = true;
      l.ffn.router = b.matrix(E, H);
      for (int64_t e = 0; e < E; ++e) {
        FfnExpert x;
        if (experts == QuantKind::None) {
          x.gate = b.matrix(I, H);
          x.up = b.matrix(I, H);
          x.down = b.matrix(H, I);
        } else if (experts == QuantKind::Fp8Block) {
          x.gate = b.fp8(I, H);
          x.up = b.fp8(I, H);
          x.down = b.fp8(H, I);
        } else {
          x.gate = b.quantized(I, H, experts, group);
          x.up = b.quantized(I, H, experts, group);
          x.down = b.quantized(H, I, experts, group);
        }
        l.ffn.experts.push_back(x);
      }
      if (Is > 0) {
        l.ffn.has_shared = true;
        l.ffn.shared = {lin(Is, H), lin(Is, H), lin(H, Is)};
        l.ffn.shared_gate = b.matrix(1, H);
      }
    } else {
      const int64_t Id = c.intermediate_size;
      l.ffn.dense = {lin(Id, H), lin(Id, H), lin(H, Id)};
    }
    return l;
  };
  for (int64_t i = 0; i < c.num_layers; ++i) w.layers.push_back(layer(c.layer_kinds[size_t(i)], c.layer_is_moe[size_t(i)]));
  if (mtp_head) {  // one full-attention layer with the model's FFN kind, as Qwen3.5's checkpoints have
    MtpWeights m;
    m.fc = lin(H, 2 * H);
    m.norm_embedding.assign(size_t(H), 0.f);
    m.norm_hidden.assign(size_t(H), 0.f);
    m.final_norm.assign(size_t(H), 0.f);
    m.layer = layer(LayerKind::Full, E > 0);
    w.mtp = std::move(m);
  }
  return w;
}

}  // namespace

std::unique_ptr<QwenModel> synthetic_cpu_model(const ModelConfig& config, QuantKind experts, int group, uint64_t seed,
                                               ThreadPool& pool, bool fp8_weights, bool mtp_head) {
  if (fp8_weights && experts != QuantKind::Fp8Block) fail("bench: FP8 weights come with FP8 experts");
  ModelConfig c = config;
  c.tie_word_embeddings = true;
  Arena count;
  count.counting = true;
  build_weights(c, experts, group, seed, count, pool, fp8_weights, mtp_head);
  const uint64_t avail = available_memory_bytes();
  if (avail > 0 && count.bytes > avail)
    fail("bench --synthetic: " + std::to_string(c.num_layers) + " layers of this model need " +
         std::to_string(count.bytes >> 20) + " MiB of weights and " + std::to_string(avail >> 20) +
         " MiB of memory is available; give fewer with --layers");
  auto arena = std::make_shared<Arena>();
  ModelWeights w = build_weights(c, experts, group, seed, *arena, pool, fp8_weights, mtp_head);
  return QwenModel::from_memory(std::move(c), std::move(w), std::move(arena));
}

}  // namespace flashmoe
