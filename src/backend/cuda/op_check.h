// Single kernels of the CUDA decode step run on host data, for tests that
// hold each op against the CPU's (tests/cuda_ops_test.cpp), the way ggml's
// test-backend-ops checks a backend op by op. Test-only. Plain C++ header;
// each function needs a usable device (CudaModel::available) and throws
// DeviceError without one (op_check_stub.cpp in builds without CUDA).
#pragma once
#include <cstdint>
#include <vector>

#include "core/matrix.h"

namespace flashmoe::cuda_ops {

// y = W . x, or W . rmsnorm_zc(x, norm_w, eps) when norm_w is not empty,
// through the decode step's matvec_kernel (W bf16, f16 or f32; its rows a
// multiple of 16 bytes). three_rows: 3 rows per warp at a time (else 2).
// W in FP8 blocks (columns and block width multiples of 16): through
// matvec_fp8_kernel on W as a DT_FP8 matrix (per-row scales), 3 rows per
// warp at a time, else 4; blocks a multiple of 64 columns wide through
// matvec_fp8_mma_kernel.
std::vector<float> matvec(const Matrix& W, const std::vector<float>& x, const std::vector<float>& norm_w, float eps,
                          bool three_rows);

// The decode step's router top-k (topk_kernel): softmax over logits[0, E),
// the k largest (ties: the lower index), their weights renormalised when
// norm; with shared, w[k] = sigmoid(logits[E]). E <= 512, k <= 32.
void topk(const std::vector<float>& logits, int E, int k, bool norm, bool shared, std::vector<int>* ids,
          std::vector<float>* w);

// One GatedDeltaNet decode step after the conv (delta_kernel, or
// delta_cluster_kernel when cluster, 8 value columns per block so that
// small heads run clusters): q, k, v from conv ([nk*dk | nk*dk | nv*dv]),
// z, b, a from the projection; S [nv][dk][dv] is updated; returns the gated
// normed output [nv*dv].
struct DeltaStep {
  int nk = 0, nv = 0, dk = 0, dv = 0;
  float eps = 1e-6f;
  std::vector<float> conv, z, b, a, dt_bias, neg_exp_A, norm_w, S;
};
std::vector<float> delta_step(DeltaStep& d, bool cluster);

// Decode attention of one token (attn_kernel) over a full KV cache that
// holds positions 0..n-1, the last being the token's own: q and gate
// [nh*hd] (the output is gated by sigmoid(gate)), K and V [n][nkv*hd],
// stored on the device as `kv`; `split` blocks (a cluster) per query head;
// prefetch: the decode step's L2 prefetch of the earlier rows. Returns the
// gated output [nh*hd].
enum class KvStore { F32, BF16, F16 };
struct AttnDecode {
  int nh = 0, nkv = 0, hd = 0, n = 0;
  KvStore kv = KvStore::F32;
  std::vector<float> q, gate, k, v;
};
std::vector<float> attention(const AttnDecode& a, int split, bool prefetch);

// The routed experts of a MoE layer in q8/q4 (gate_up_q_kernel then
// down_q_kernel, no shared expert) or FP8 blocks (gate_up_fp8_kernel,
// down_fp8_kernel; block_row0 0): x + sum_j w[j] * down_j(silu(gate_j xn)
// * up_j xn), xn = rmsnorm_zc(x, norm_w, eps). Every matrix quantised alike
// (kind, group, block rows); gate and up [I][H], down [H][I]. FP8 blocks a
// multiple of 64 columns wide: the tensor-core kernels.
struct QuantExpert {
  Matrix gate, up, down;
};
// shared: an FP8 shared expert beside FP8 routed ones (its weight w[k]),
// laid out as the upload lays out DT_FP8 matrices (per-row block scales).
std::vector<float> quant_experts(const std::vector<QuantExpert>& experts, const std::vector<float>& w,
                                 const std::vector<float>& x, const std::vector<float>& norm_w, float eps,
                                 const QuantExpert* shared = nullptr);

// y = W . x for W in a GGUF block format (Q8_0 ... IQ4_XS), through the
// decode step's gmatvec_staged_kernel (staged: runs of rows copied into
// shared memory, then decoded there) or gmatvec_kernel (the blocks read
// from global memory, for rows too long to stage).
std::vector<float> gguf_matvec(const Matrix& W, const std::vector<float>& x, bool staged);

// The routed experts of a MoE layer in GGUF blocks through the decode
// step's staged kernels: ggate_up_staged_kernel picks the k experts from
// the router's logits [E] itself (softmax, top-k, renormalised), then
// gdown_staged_kernel: x + sum_j w_j * down_j(silu(gate_j . xn) * (up_j .
// xn)), xn = rmsnorm_zc(x, norm_w, eps). Gate and up [I][H], down [H][I];
// each of the three in one block kind across the experts. ids, w: the pick.
// chunks: the experts rearranged into the chunk layout as upload.cu does
// (Q4_K / Q6_K; gguf_chunks.cuh) and read by gguf_chunk_experts.cuh's
// kernels instead (the same pick inside gate_up). shared (chunks only): a
// shared expert in stored blocks too, its output weighted by
// sigmoid(logits[E]) (logits then has E + 1 entries; w gets k + 1);
// shared_chunks: that shared expert copied into the chunk layout as
// upload.cu copies one stored as the routed experts are (gc_shared_joins).
struct GgufExpert {
  Matrix gate, up, down;
};
std::vector<float> gguf_experts(const std::vector<GgufExpert>& experts, const std::vector<float>& logits, int k,
                                const std::vector<float>& x, const std::vector<float>& norm_w, float eps,
                                std::vector<int>* ids, std::vector<float>* w, bool chunks = false,
                                const GgufExpert* shared = nullptr, bool shared_chunks = false);
// C = A . W^T (A: T rows of W.cols) for W in a GGUF block format, through
// the batched prefill's product (gemm_kernel<GB>, bm rows per tile: 16, 32, 64).
// repacked: W's rows repacked as the upload repacks dense matrices (gguf_dense_layout.cuh).
std::vector<float> gguf_gemm(const Matrix& W, const std::vector<float>& A, int T, int bm, bool repacked = false);

// y0 + W . xn (y0 empty: zeros) for the parts of W (stacked rows, same
// columns, GGUF kinds with a repacked form) repacked as the upload repacks
// the decode step's dense matrices, through gdense_matvec_kernel; xn =
// rmsnorm_zc(x, norm_w, eps), or x when norm_w is empty.
std::vector<float> gguf_dense_matvec(const std::vector<Matrix>& parts, const std::vector<float>& x,
                                     const std::vector<float>& norm_w, float eps, const std::vector<float>& y0);

// The routed experts of a batched step with few rows per picked expert
// (few_rows_kernel: gate/up with SiLU, then down) over the tile list of
// `ids` (row t's k picks at ids[t*k .. t*k+k), built here, up to kFewRows
// rows per tile as route_lists_kernel builds it; an expert may be picked by
// no row or by many). Returns y [T*k][H]: y[t*k + j] = down_e(silu(gate_e .
// x_t) * (up_e . x_t)), e = ids[t*k + j], x [T][H]. Every expert's gate_up
// [2I][H] (gate rows, then up rows) and down [H][I] stored alike: bf16,
// f16 or f32.
struct DenseExpert {
  Matrix gate_up, down;
};
std::vector<float> few_rows_experts(const std::vector<DenseExpert>& experts, const std::vector<float>& x, int T,
                                    const std::vector<int>& ids, int k);

// The batched step's dense product of a few rows (skinny_gemm_kernel, K
// split over a cluster as the step splits it on this device): A [T][K]
// (T <= 64) times bf16 W [N][K] (K % 8 == 0) transposed. mode 0: C = A .
// W^T; 1: C = C0 + A . W^T; 2 (swiglu): C[t][j] = silu(gate_j . a_t) *
// (up_j . a_t), gate rows [0, N/2), up rows [N/2, N). C and C0: [T][ldc],
// ldc = N (swiglu: N / 2).
std::vector<float> skinny_gemm(const Matrix& W, const std::vector<float>& A, int T, int mode,
                               const std::vector<float>& C0);
// The same with A handed over split into hi/lo bf16 rows (split on the host
// as the batched step's norms split them), and for swiglu C's split rows
// ([T][ldc] bf16 bits) returned in c_hi / c_lo, as the next product reads them.
std::vector<float> skinny_gemm_split(const Matrix& W, const std::vector<float>& A, int T, int mode,
                                     const std::vector<float>& C0, std::vector<uint16_t>& c_hi,
                                     std::vector<uint16_t>& c_lo);

}  // namespace flashmoe::cuda_ops
