// The dense products of a few rows (a batched decode step: T <= 64 tokens)
// over bf16 weights: C[T][N] (=, +=, swiglu) = A[T][K] . W^T.
//
// At T = 32 the tiled products (gemm_pipe_kernel: 128 weight rows by T
// tokens per block, the whole K) gave the 35B's out-proj (2,048 rows) 16
// blocks on 132 SMs: ~0.3 TB/s. Here every block streams its weight rows
// once, straight from global memory into registers (16-byte loads, the next
// 64 columns in flight while these are multiplied), with no shared-memory
// staging. Each warp reads the activations of all T tokens for its 32
// weight rows, so the cost grows with T: on the H200 it beat the tiled
// product everywhere at 8 rows and lost at 64 (Prefill::skinny picks by the
// measurements, bench/NOTES-cuda.md, batch-fixed). Where the kernel before
// left them split into hi/lo bf16 (a.Ahi / a.Alo: the norms, the combine,
// a swiglu product's epilogue) the warps read those; else they split fp32
// rows in registers. The same bits either way; reading the split rows made
// the 35B's B = 32 step 0.8-1.0% faster (bench/NOTES-cuda.md, session 17).
//  - the tensor cores with the weights as the 16-row operand and the tokens
//    as the 8-column one (mma m16n8k16, one 8-token tile per 8 rows of T);
//  - a lane's 16-byte load (8 consecutive columns of one weight row) feeds
//    two mma k-steps: the order of k inside the dot products is permuted,
//    the same way for the weights and the activations, so the activation
//    operand is also 8 consecutive columns of one token (two float4 loads,
//    split into hi/lo bf16 in registers, as gemm.cuh's precision scheme);
//  - K is split over a cluster of up to 8 blocks so that even 2,048 rows fill
//    the GPU; the blocks' partial tiles are summed through distributed shared
//    memory in rank order (deterministic), each block writing a share of the
//    outputs (store, add or swiglu as gemm_epilogue).
#pragma once
#include <cooperative_groups.h>

#include "backend/cuda/gemm.cuh"

namespace flashmoe::cuda {

constexpr int kSkinnyWarps = 4;                 // warps along the weight rows
constexpr int kSkinnyRows = 32 * kSkinnyWarps;  // weight rows per block: 32 per warp (two 16-row mma tiles)
// Warps along K inside a block (KW): each group of kSkinnyWarps warps takes
// every KW-th 64 columns of the block's slice, and the groups' partial tiles
// are summed in shared memory in a fixed order. At 32 rows a block of one
// group left the SMs at ~4 warps each on the 35B's out-proj (16 blocks of
// 128 rows, K split over 8): too few loads in flight.
constexpr int kSkinnyKWarps = 2;
constexpr int skinny_threads(int kw) { return 32 * kSkinnyWarps * kw; }
constexpr int kSkinnyMaxSplit = 8;              // blocks per cluster along K (the portable cluster size)
constexpr int kSkinnyMaxRows = 64;              // tokens (8 tiles of 8)
// The routed experts (grouped): rows per tile of an expert's token list
// (route_lists_kernel's BM), and the mean rows per picked expert, T * k / E,
// up to which the default takes this kernel for them.
constexpr int kSkinnyExpertRows = 16;
constexpr double kSkinnyExpertMean = 0.25;

// hi = bf16(x), lo = bf16(x - hi) of two floats, packed as an mma operand (first value in the low half).
__device__ __forceinline__ void skinny_split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

__device__ __forceinline__ void skinny_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t skinny_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Dense: a.M <= 8 * NT rows of a.A (fp32, row stride a.lda), K % 8 == 0,
// 16-byte aligned rows. Grid: x = the K split (one cluster), y = blocks of
// kSkinnyRows weight rows (swiglu: half gate rows, half the up rows that
// pair with them); kslice: columns per block, a multiple of 32.
// Grouped (a.tiles: the routed experts): z = the tile, rows [first, end)
// (at most 8 * NT) of the expert's weights a.wtab[group], A rows gathered
// through a.arow, C rows scattered through a.crow (each where not null).
// PS: the activations come split (a.Ahi / a.Alo, bf16 rows of stride
// a.lda, lda % 8 == 0): two 16-byte loads per 8 columns of a token, no split
// in the loop.
template <int NT, int KW, bool PS>
__global__ void __launch_bounds__(skinny_threads(KW), NT <= 4 ? 2 : 1) skinny_gemm_kernel(GemmArgs a, int kslice) {
  constexpr int TP = 8 * NT, LD = kSkinnyRows + 4, HB = kSkinnyRows / 2, NTH = skinny_threads(KW);
  __shared__ __align__(16) float part[TP][LD];  // this block's partial sums [token][local weight row]
  const int split = int(gridDim.x), rank = int(blockIdx.x);
  const int tid = int(threadIdx.x), warp = (tid >> 5) % kSkinnyWarps, kw = (tid >> 5) / kSkinnyWarps;
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bool swiglu = a.mode == GEMM_SWIGLU;
  const __nv_bfloat16* W;
  int m0 = 0, rows = a.M;
  // Under PDL (a batched decode step): a dense product's first weights are
  // loaded before the wait (nothing writes them); the routed experts' tile
  // list comes from the kernel before.
  if (a.tiles) {
    pdl_wait();
    pdl_trigger();
    if (int(blockIdx.z) >= *a.ntiles) return;
    const int* tl = a.tiles + 3 * blockIdx.z;
    W = static_cast<const __nv_bfloat16*>(a.wtab[tl[0]]);
    m0 = tl[1];
    rows = tl[2] - tl[1];
  } else {
    W = static_cast<const __nv_bfloat16*>(a.W);
  }
  // This lane's weight rows: local rows warp * 32 + g + 8 * i (tile i / 2, row g or g + 8).
  const __nv_bfloat16* wr[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = warp * 32 + g + 8 * i;
    int r;
    bool ok;
    if (swiglu) {
      const int j = int(blockIdx.y) * HB + n % HB;
      ok = j < a.half;
      r = n < HB ? j : a.half + j;
    } else {
      r = int(blockIdx.y) * kSkinnyRows + n;
      ok = r < a.N;
    }
    wr[i] = ok ? W + size_t(r) * a.K : nullptr;
  }
  // This lane's tokens: 8 * j + g of tile j, from element xo[j] of A (or
  // its split rows); -1: none.
  // (32 bits: at most 64 rows of activations, or a step's T * k expert rows.)
  int xo[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int m = 8 * j + g;
    xo[j] = m < rows ? (a.arow ? a.arow[m0 + m] : m0 + m) * a.lda : -1;
  }
  const int k0 = rank * kslice, k1 = min(a.K, k0 + kslice);
  float acc[2][NT][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
  // Weights of columns [k, k + 64): chunk c of 32, this lane's 8 at k + 32 c + 8 t.
  auto load_w = [&](uint4 (&w)[2][4], int k) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = k + 32 * c + 8 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) w[c][i] = wr[i] && col < k1 ? ld_stream(wr[i] + col) : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 w[2][4];
  load_w(w, k0 + 64 * kw);
  if (!a.tiles) {
    pdl_wait();
    pdl_trigger();
  }
  for (int k = k0 + 64 * kw; k < k1; k += 64 * KW) {
    uint4 wn[2][4];
    load_w(wn, k + 64 * KW);  // in flight while these 64 columns are multiplied
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = k + 32 * c + 8 * t;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        uint32_t hi[4], lo[4];
        if constexpr (PS) {
          uint4 h = make_uint4(0, 0, 0, 0), l = h;
          if (xo[j] >= 0 && col < k1) {
            h = *reinterpret_cast<const uint4*>(a.Ahi + xo[j] + col);
            l = *reinterpret_cast<const uint4*>(a.Alo + xo[j] + col);
          }
          hi[0] = h.x, hi[1] = h.y, hi[2] = h.z, hi[3] = h.w;
          lo[0] = l.x, lo[1] = l.y, lo[2] = l.z, lo[3] = l.w;
        } else {
          float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
          if (xo[j] >= 0 && col < k1) {
            x0 = *reinterpret_cast<const float4*>(a.A + xo[j] + col);
            x1 = *reinterpret_cast<const float4*>(a.A + xo[j] + col + 4);
          }
          skinny_split2(x0.x, x0.y, hi[0], lo[0]);
          skinny_split2(x0.z, x0.w, hi[1], lo[1]);
          skinny_split2(x1.x, x1.y, hi[2], lo[2]);
          skinny_split2(x1.z, x1.w, hi[3], lo[3]);
        }
        // k-step s: columns 8t + 4s .. + 3 of the chunk stand for the
        // mma's k = 2t, 2t + 1 (words 2s) and 2t + 8, 2t + 9 (words 2s + 1).
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            const uint32_t a0 = skinny_word(w[c][2 * mt], 2 * s), a1 = skinny_word(w[c][2 * mt + 1], 2 * s);
            const uint32_t a2 = skinny_word(w[c][2 * mt], 2 * s + 1), a3 = skinny_word(w[c][2 * mt + 1], 2 * s + 1);
            skinny_mma(acc[mt][j], a0, a1, a2, a3, lo[2 * s], lo[2 * s + 1]);  // the small terms first
            skinny_mma(acc[mt][j], a0, a1, a2, a3, hi[2 * s], hi[2 * s + 1]);
          }
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) w[c][i] = wn[c][i];
  }
  // Accumulator e of tile (mt, j): weight row g (+8 for e >= 2), token 2t
  // (+1 for odd e). The K groups in turn, the last first (a fixed order).
  for (int q = KW - 1; q >= 0; --q) {
    if (kw == q) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& p = part[8 * j + 2 * t + (e & 1)][warp * 32 + mt * 16 + g + 8 * (e >> 1)];
            p = q == KW - 1 ? acc[mt][j][e] : p + acc[mt][j][e];
          }
    }
    if (q > 0) __syncthreads();
  }
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  if (split > 1) cl.sync();
  else __syncthreads();
  auto sum = [&](int m, int n) {
    if (split == 1) return part[m][n];
    float v = 0.f;
    for (int q = 0; q < split; ++q) v += *cl.map_shared_rank(&part[m][n], q);
    return v;
  };
  const int per = swiglu ? HB : kSkinnyRows, total = rows * per;
  for (int e = rank * NTH + tid; e < total; e += split * NTH) {
    const int m = e / per, n = e % per;
    const size_t row = size_t(a.crow ? a.crow[m0 + m] : m0 + m) * a.ldc;
    float* crow = a.C + row;
    if (swiglu) {
      const int col = int(blockIdx.y) * HB + n;
      if (col < a.half) {
        const float v = siluf_(sum(m, n)) * sum(m, HB + n);
        crow[col] = v;
        if (a.Chi) split_bf16(v, a.Chi[row + col], a.Clo[row + col]);
      }
      continue;
    }
    const int col = int(blockIdx.y) * kSkinnyRows + n;
    if (col >= a.N) continue;
    float* c = crow + col;
    const float v = sum(m, n);
    if (a.mode == GEMM_ADD) *c += v;
    else *c = v;
  }
  if (split > 1) cl.sync();  // no block leaves while another still reads its partial sums
}

// Whether a's split activations can be read (given, in 16-byte aligned rows).
inline bool skinny_split_given(const GemmArgs& a) {
  return a.Ahi && a.Alo && a.lda % 8 == 0 && reinterpret_cast<uintptr_t>(a.Ahi) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.Alo) % 16 == 0;
}

// skinny_gemm_kernel over a (see the kernel; dense: a.M <= kSkinnyMaxRows;
// grouped: up to `ntiles` tiles of at most `tile_rows` <= kSkinnyMaxRows
// rows), on a device of `sms` SMs: K split over a cluster until the blocks
// fill the SMs twice over, each block keeping at least 64 columns. The
// split activations are read where skinny_split_given, else a.A.
inline cudaError_t launch_skinny_gemm(const GemmArgs& a, int sms, cudaStream_t st, int ntiles = 1,
                                      int tile_rows = 0, bool pdl = false) {
  const int blocks = a.mode == GEMM_SWIGLU ? (a.half + kSkinnyRows / 2 - 1) / (kSkinnyRows / 2)
                                           : (a.N + kSkinnyRows - 1) / kSkinnyRows;
  const int M = a.tiles ? tile_rows : a.M;
  int split = 1;
  while (split < kSkinnyMaxSplit && int64_t(blocks) * ntiles * split < 2 * int64_t(sms) && a.K >= 2 * 64 * split)
    split *= 2;
  const int kslice = ((a.K + 31) / 32 + split - 1) / split * 32;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(split), unsigned(blocks), unsigned(a.tiles ? ntiles : 1));
  cfg.blockDim = dim3(unsigned(skinny_threads(kSkinnyKWarps)));
  cfg.stream = st;
  cudaLaunchAttribute at[2];
  int n = 0;
  if (split > 1) {
    at[n].id = cudaLaunchAttributeClusterDimension;
    at[n++].val.clusterDim = {unsigned(split), 1, 1};
  }
  if (pdl) {  // programmatic dependent launch: the kernel waits in pdl_wait()
    at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cfg.attrs = at;
  cfg.numAttrs = n;
  auto go = [&](auto kern) { return cudaLaunchKernelEx(&cfg, kern, a, kslice); };
  constexpr int W = kSkinnyKWarps;
  if (skinny_split_given(a)) {
    if (M <= 8) return go(skinny_gemm_kernel<1, W, true>);
    if (M <= 16) return go(skinny_gemm_kernel<2, W, true>);
    if (M <= 32) return go(skinny_gemm_kernel<4, W, true>);
    return go(skinny_gemm_kernel<8, W, true>);
  }
  if (M <= 8) return go(skinny_gemm_kernel<1, W, false>);
  if (M <= 16) return go(skinny_gemm_kernel<2, W, false>);
  if (M <= 32) return go(skinny_gemm_kernel<4, W, false>);
  return go(skinny_gemm_kernel<8, W, false>);
}

}  // namespace flashmoe::cuda
