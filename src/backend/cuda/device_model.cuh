// The uploaded model's device-side layout (weights per layer), shared by
// the decode step (cuda_model.cu) and the batched prefill (prefill.cu).
#pragma once
#include <cstddef>
#include <string>

#include "backend/cuda/tier_count.cuh"
#include "core/dtype.h"
#include "core/error.h"

namespace flashmoe::cuda {

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
inline int dt_of(DType t) {
  switch (t) {
    case DType::F32: return DT_F32;
    case DType::F16: return DT_F16;
    case DType::BF16: return DT_BF16;
    default: fail(std::string("CUDA backend: weights of type ") + dtype_name(t) + " are not supported");
  }
}
inline size_t dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

struct DMat {
  int dt = DT_F32;
  void* p = nullptr;
  int rows = 0, cols = 0;
  size_t bytes() const { return size_t(rows) * cols * dt_size(dt); }
};

struct DLayer {
  bool full = false;
  float *in_norm = nullptr, *post_norm = nullptr;
  DMat lin_in, out_proj;  // [C + nv*dv + 2nv, H] (q,k,v | z | b | a), [H, nv*dv]
  float *conv_w = nullptr, *dt_bias = nullptr, *neg_exp_A = nullptr, *gnorm = nullptr;
  DMat qkv, o_proj;  // [2nh*hd + 2nkv*hd, H], [H, nh*hd]
  float *q_norm = nullptr, *k_norm = nullptr;
  bool moe = false;
  DMat router;  // [E (+1: shared expert gate), H]
  int edt = DT_BF16;
  void *gu = nullptr, *down = nullptr;  // routed experts [E][2I][H], [E][H][I] (null when tiered)
  const void* const* gu_tab = nullptr;  // [E] device pointers of each expert's rows (see ExpertTiers)
  const void* const* down_tab = nullptr;
  TierCount tc{};  // choice accounting (tiered cache only)
  bool has_shared = false;              // shared expert (MoE) or dense MLP
  DMat s_gu, s_down;                    // [2Is, H], [H, Is]
  float* rfold = nullptr;               // folded router [router rows][H + O] (outproj_router_kernel), or null
};

}  // namespace flashmoe::cuda
