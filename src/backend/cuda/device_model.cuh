// The uploaded model's device-side layout (weights per layer), shared by
// the decode step (decode_step.cu) and the batched prefill (prefill.cu).
#pragma once
#include <cstddef>
#include <string>

#include "backend/cuda/gguf_blocks.cuh"
#include "backend/cuda/tier_count.cuh"
#include "core/dtype.h"
#include "core/error.h"
#include "core/matrix.h"
#include "format/config.h"

namespace flashmoe::cuda {

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum { DT_Q4 = 3, DT_Q8 = 4 };  // quantised routed experts (QExpert), in the prefill's product dispatch only
// GGUF block formats (ggml's Q8_0 ... IQ4_XS), kept as stored: rows of
// self-contained blocks, the kind per part of the matrix (GMat).
enum { DT_GGUF = 5 };
// FP8 blocks (E4M3 codes and fp32 block scales): a DMat's storage type, and
// in the prefill's product dispatch also the routed experts' (QExpert fp8).
enum { DT_FP8 = 6 };
inline int dt_of(DType t) {
  switch (t) {
    case DType::F32: return DT_F32;
    case DType::F16: return DT_F16;
    case DType::BF16: return DT_BF16;
    default:
      fail_device(DeviceFailure::Unsupported,
                  std::string("CUDA backend: weights of type ") + dtype_name(t) + " are not supported");
  }
}
inline size_t dt_size(int dt) { return dt == DT_F32 ? 4 : dt == DT_FP8 ? 1 : 2; }

// The device storage type of a host matrix: its own, or f32 for q8/q4
// weights outside the routed experts (an MLX checkpoint's projections,
// embeddings, shared experts), dequantised at upload: the kernels of every
// other model then run them, on exactly the CPU's weights. (Rounded to bf16
// instead, coder-mini's logits moved by up to 1.4 against the CPU, mean KL
// 4e-5 for q4 and 2.5e-4 for q8: the rounding flips expert choices.)
// GGUF block formats stay as stored (DT_GGUF).
inline int storage_dt(const Matrix& m) {
  return m.block_quantized() ? DT_GGUF : m.quantized() ? DT_F32 : dt_of(m.dtype);
}

// A device matrix [rows][cols] in storage type dt. DT_FP8: the E4M3 codes
// [rows][cols], then at scale_offset() each row's fp32 block scales
// [rows][ceil(cols / group)] (per row, not per block row: a DMat may stack
// several checkpoint matrices whose block rows start at their own row 0).
struct DMat {
  int dt = DT_F32;
  void* p = nullptr;
  int rows = 0, cols = 0;
  GMat g;              // dt == DT_GGUF: the parts' kinds and offsets
  size_t gbytes = 0;   // dt == DT_GGUF: bytes of all parts
  int group = 0;       // dt == DT_FP8: columns per scale block
  int blocks_per_row() const { return dt == DT_FP8 ? (cols + group - 1) / group : 0; }
  size_t scale_offset() const { return (size_t(rows) * cols + 15) / 16 * 16; }
  const float* row_scales() const {
    return reinterpret_cast<const float*>(static_cast<const uint8_t*>(p) + scale_offset());
  }
  size_t bytes() const {
    if (dt == DT_GGUF) return gbytes;
    if (dt == DT_FP8) return scale_offset() + size_t(rows) * blocks_per_row() * 4;
    return size_t(rows) * cols * dt_size(dt);
  }
  // Bytes of row r (an embedding row's prefetch).
  size_t row_bytes(int r = 0) const {
    return dt == DT_GGUF ? gguf_row_bytes(g.kind[gmat_part(g, r)], cols) : size_t(cols) * dt_size(dt);
  }
};

// A quantised routed expert (q8/q4: group-wise affine, the MLX layout of
// core/matrix.h) as the device keeps it, in the two blocks the tier tables
// point at: gate/up = gate rows, gate scales, gate biases, up rows, up
// scales, up biases; down = down rows, scales, biases. Offsets in bytes from
// the block's start, each 16-byte aligned (the kernels' vector loads).
//
// FP8 block experts (fp8 set; fp8_experts.cuh): the checkpoint's records as
// they are: gate codes [I][H] (one E4M3 byte each), gate scales fp32
// [ceil(I / block_rows)][ceil(H / group)], up codes, up scales; down codes
// [H][I], down scales. gate_b / up_b / dn_b are unused (no biases).
struct QExpert {
  int bits = 0, group = 0;  // bits 0: the experts are not quantised
  bool fp8 = false;         // FP8 blocks (bits 8, group: block columns)
  int block_rows = 0;       // fp8: rows per scale block
  int gu_row = 0, dn_row = 0;  // bytes per row of gate/up and of down
  size_t gate_s = 0, gate_b = 0, up_w = 0, up_s = 0, up_b = 0, gu_bytes = 0;
  size_t dn_s = 0, dn_b = 0, dn_bytes = 0;
};
inline QExpert make_qexpert(int bits, int group, int H, int I) {
  auto up16 = [](size_t x) { return (x + 15) / 16 * 16; };
  QExpert q;
  q.bits = bits;
  q.group = group;
  q.gu_row = H * bits / 8;
  q.dn_row = I * bits / 8;
  const size_t gw = size_t(I) * q.gu_row, gs = size_t(I) * (H / group) * 2;
  q.gate_s = up16(gw);
  q.gate_b = up16(q.gate_s + gs);
  q.up_w = up16(q.gate_b + gs);
  q.up_s = up16(q.up_w + gw);
  q.up_b = up16(q.up_s + gs);
  q.gu_bytes = up16(q.up_b + gs);
  const size_t dw = size_t(H) * q.dn_row, ds = size_t(H) * (I / group) * 2;
  q.dn_s = up16(dw);
  q.dn_b = up16(q.dn_s + ds);
  q.dn_bytes = up16(q.dn_b + ds);
  return q;
}

inline QExpert make_fp8expert(int group, int block_rows, int H, int I) {
  auto up16 = [](size_t x) { return (x + 15) / 16 * 16; };
  auto nb = [](int n, int b) { return size_t((n + b - 1) / b); };
  QExpert q;
  q.bits = 8;
  q.fp8 = true;
  q.group = group;
  q.block_rows = block_rows;
  q.gu_row = H;
  q.dn_row = I;
  const size_t gw = size_t(I) * H, gs = nb(I, block_rows) * nb(H, group) * 4;
  q.gate_s = up16(gw);
  q.up_w = up16(q.gate_s + gs);
  q.up_s = up16(q.up_w + gw);
  q.gu_bytes = up16(q.up_s + gs);
  q.gate_b = q.up_b = 0;
  const size_t dw = size_t(H) * I, ds = nb(H, block_rows) * nb(I, group) * 4;
  q.dn_s = up16(dw);
  q.dn_bytes = up16(q.dn_s + ds);
  q.dn_b = 0;
  return q;
}

// One layer's weights on the device; which parts are set follows its
// LayerPlan (model/plan.h): lin_in .. gnorm for a GatedDeltaNet, qkv ..
// k_norm for gated attention, router and experts for a routed MoE.
struct DLayer {
  float *in_norm = nullptr, *post_norm = nullptr;
  DMat lin_in, out_proj;  // [C + nv*dv + 2nv, H] (q,k,v | z | b | a), [H, nv*dv]
  float *conv_w = nullptr, *dt_bias = nullptr, *neg_exp_A = nullptr, *gnorm = nullptr;
  bool v_tiled = false;  // value heads in llama.cpp's tiled order (DeltaArgs::tiled)
  DMat qkv, o_proj;  // [2nh*hd + 2nkv*hd, H], [H, nh*hd]
  float *q_norm = nullptr, *k_norm = nullptr;
  DMat router;  // [E (+1: shared expert gate), H]
  int edt = DT_BF16;  // storage type of the shared expert / dense MLP, and of the routed experts unless quantised
  QExpert q;          // the routed experts' quantisation (q.bits 0: none, stored as edt)
  void *gu = nullptr, *down = nullptr;  // routed experts [E][2I][H], [E][H][I] (null when tiered)
  const void* const* gu_tab = nullptr;  // [E] device pointers of each expert's rows (see ExpertTiers)
  const void* const* down_tab = nullptr;
  TierCount tc{};  // choice accounting (tiered cache only)
  // GGUF routed experts (gg.n > 0), stored as in the file: an expert's
  // gate/up block holds its gate rows then its up rows (gg: parts at rows 0
  // and I, offsets from the block's start), its down block the down rows (gd).
  GMat gg, gd;
  bool has_shared = false;              // shared expert (MoE) or dense MLP
  DMat s_gu, s_down;                    // [2Is, H], [H, Is]
  void *s_gu_c = nullptr, *s_down_c = nullptr;  // GGUF: the shared expert in the routed experts' chunk layout, or null
  float* rfold = nullptr;               // folded router [router rows][H + O] (outproj_router_kernel), or null
};

// A GatedDeltaNet layer's part of the delta rule's arguments, the same for
// the decode step (DeltaArgs), the batched step (a DeltaArgs a sequence) and
// the prompt pass (DeltaRowsArgs): z, b and a after the conv's C channels in
// the in-projection's row, the layer's parameters, the heads' shape.
template <typename DeltaLayerArgs>
void fill_delta_layer(DeltaLayerArgs& a, const ModelConfig& c, const DLayer& d) {
  const int C = int(c.lin_conv_dim()), nv = int(c.lin_num_v_heads), dv = int(c.lin_v_dim);
  a.zoff = C;
  a.boff = C + nv * dv;
  a.aoff = C + nv * dv + nv;
  a.dt_bias = d.dt_bias;
  a.neg_exp_A = d.neg_exp_A;
  a.norm_w = d.gnorm;
  a.nk = int(c.lin_num_k_heads);
  a.tiled = d.v_tiled ? 1 : 0;
  a.nv = nv;
  a.dk = int(c.lin_k_dim);
  a.dv = dv;
  a.eps = c.rms_norm_eps;
}

}  // namespace flashmoe::cuda
