// The matrix product of the batched prefill: C = A . W^T for a chunk of
// tokens (A: fp32 activations, one row per token; W: weights [N][K] in their
// storage type), on the tensor cores (bf16 mma through WMMA, fp32
// accumulators).
//
// Precision: bf16 has 8 significant bits, too few for the fp32 math path the
// golden tests hold the backend to. Each fp32 activation is split into two
// bf16 numbers, hi = bf16(a) and lo = bf16(a - hi), 16 significant bits
// together; a bf16 weight is exact, so A.W = hi.W + lo.W is two products
// (relative error ~2^-17 per term, against 2^-9 for plain bf16). f16 and
// f32 weights are split the same way (an f16 weight exactly, an f32 one to
// 16 bits) and take a third product, hi_a . lo_w.
//
// q8/q4 weights (T = QW<bits>, the routed experts of packed models) are
// dequantised as their tiles are stored, w = q * scale + bias in fp32, and
// split like f32 weights. So are GGUF block weights (T = GB, parts and
// kinds in GemmArgs::gm): each thread expands its 8 weights of a row from
// their block (gguf_blocks.cuh) into registers on the way to shared memory.
// FP8 block weights (T = F8W): where a block spans a multiple of kGemmBK
// columns (every checkpoint's 128), the codes themselves are the bf16
// weights (E4M3 is exact in bf16: no low part), each block's products go to
// accumulators of their own, and the block's fp32 scale multiplies those
// fp32 sums, as the CPU's FP8 rows do. The activations are split into three
// bf16 parts (hi, mid, lo: all 24 bits of an fp32), so a product of a code
// and an activation is exact and only the fp32 sums round: a two-part split
// (16 bits) was the largest error left against the CPU and HF (issue 23).
// The scale is one per warp and block of columns where the warp's 16 rows
// share it (the routed experts: blocks of a multiple of 16 rows), applied
// to the fragments; else (the projections, whose rows carry their own
// scales: stacked matrices) one per row, applied to the block's sums
// through a per-warp staging tile in shared memory. Blocks of other widths
// take w = e4m3(code) * scale split into bf16 hi/lo, as f32 weights.
//
// Rows can be gathered (A row of output row m: arow[m]) and scattered
// (C row: crow[m]); grouped mode (the routed experts) takes its row ranges
// and weights from a tile list built on the device (route_lists_kernel).
#pragma once
#include <mma.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gguf_blocks.cuh"

namespace flashmoe::cuda {

enum GemmMode { GEMM_STORE = 0, GEMM_ADD = 1, GEMM_SWIGLU = 2 };

struct GemmArgs {
  const float* A = nullptr;  // [rows][lda] fp32
  int lda = 0;
  // skinny_gemm_kernel: A's rows already split into hi/lo bf16 (the same
  // rows and stride lda), read instead of A where not null.
  const __nv_bfloat16* Ahi = nullptr;
  const __nv_bfloat16* Alo = nullptr;
  const int* arow = nullptr;  // A row of output row m, or null (m)
  const void* W = nullptr;    // [N][K] row-major, storage type T
  const void* const* wtab = nullptr;  // grouped: weights of group g (W unused)
  const int* tiles = nullptr;         // grouped: [tile][3] = {group, first row, end row}; null: dense
  const int* ntiles = nullptr;        // grouped: how many tiles (blocks beyond exit)
  int M = 0, N = 0, K = 0;  // dense: M rows; N weight rows (swiglu: 2 * half)
  float* C = nullptr;       // [rows][ldc]
  int ldc = 0;
  const int* crow = nullptr;  // C row of output row m, or null (m)
  int mode = GEMM_STORE;      // store, C += result, or swiglu: C[m][j] = silu(gate_j) * up_j
  int half = 0;               // swiglu: rows of gate (the up rows follow at half)
  // Quantised weights (QW<bits>): weight row r is row r - p * qsplit of part
  // p = (r >= qsplit), whose codes, bf16 scales and biases start at byte
  // offsets qw[p], qs[p], qb[p] of the weight block (QExpert's layout).
  int qsplit = 0, qgroup = 0;
  size_t qw[2] = {}, qs[2] = {}, qb[2] = {};
  // GGUF block weights (GB): the parts of W (grouped: of each group's block).
  GMat gm;
  // F8W: rows per scale block; part p's fp32 scales at qs[p] are
  // [ceil(rows / qbrows)][ceil(K / qgroup)] (qb unused).
  int qbrows = 0;
  // swiglu (gemm_pipe_kernel, gemm_kernel, skinny_gemm_kernel): C also
  // split into hi/lo bf16 rows [rows][ldc] here (the next product's
  // activations), where not null.
  __nv_bfloat16* Chi = nullptr;
  __nv_bfloat16* Clo = nullptr;
  // Grouped, gemm_pipe_kernel: per-tile counts of finished blocks, zeroed by
  // route_lists_kernel. tile_wait 0: each block adds 1 to its tile's count
  // once its outputs are stored (gate/up); tile_wait > 0: a block waits for
  // its tile's count to reach tile_wait before reading the activations, in
  // place of the PDL wait (down: it starts while gate/up's last blocks run).
  int* tile_done = nullptr;
  int tile_wait = 0;
};

// Weight type tag of GGUF block weights.
struct GB {};

// Weight type tag of q8/q4 weights.
template <int B>
struct QW {
  static constexpr int bits = B;
};
// Weight type tag of FP8 block weights (8 codes per load, as QW<8>).
struct F8W {
  static constexpr int bits = 8;
};
template <typename T> struct is_qw : std::false_type {};
template <int B> struct is_qw<QW<B>> : std::true_type {};
template <> struct is_qw<F8W> : std::true_type {};

// One E4M3 code as a float, exactly (E4M3 fits in f16).
__device__ __forceinline__ float gemm_e4m3(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code & 0xffu), __NV_E4M3);
  return __half2float(__half(h));
}

constexpr int kGemmBN = 64, kGemmBK = 32, kGemmLd = kGemmBK + 8;  // smem row: 80 bytes (16-byte multiple)
constexpr int kGemmThreads = 128;                                  // 4 warps, one 16-column slice of BN each

// Output columns (weight rows) of one block: BN weight rows; swiglu: BN/2
// gate rows and the BN/2 up rows that pair with them.
__device__ __forceinline__ int gemm_wrow(const GemmArgs& a, int n, bool& ok) {
  if (a.mode == GEMM_SWIGLU) {
    const int j = blockIdx.x * (kGemmBN / 2) + (n % (kGemmBN / 2));
    ok = j < a.half;
    return n < kGemmBN / 2 ? j : a.half + j;
  }
  const int r = blockIdx.x * kGemmBN + n;
  ok = r < a.N;
  return r;
}

__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  lo = __float2bfloat16_rn(v - __bfloat162float(hi));
}

// The end of both product kernels (this one and gemm_pipe_kernel): the
// block's tile of results, rows [0, rows) of cs (row stride ld, BN columns
// from column blockIdx.x * BN of the output), stored to C, added to it, or
// for GEMM_SWIGLU (gate columns in the first half of the tile, up in the
// second) silu(gate) * up into BN / 2 columns. Output row m0 + m (or crow's).
template <int BM, int BN, int THREADS>
__device__ __forceinline__ void gemm_epilogue(const GemmArgs& a, const float* cs, int ld, int m0, int rows) {
  const int tid = threadIdx.x;
  if (a.mode == GEMM_SWIGLU) {
    constexpr int HB = BN / 2;
    for (int i = tid; i < BM * HB; i += THREADS) {
      const int m = i / HB, j = i % HB, col = blockIdx.x * HB + j;
      if (m >= rows || col >= a.half) continue;
      const size_t at = size_t(a.crow ? a.crow[m0 + m] : m0 + m) * a.ldc + col;
      const float v = siluf_(cs[m * ld + j]) * cs[m * ld + HB + j];
      a.C[at] = v;
      if (a.Chi) split_bf16(v, a.Chi[at], a.Clo[at]);
    }
    return;
  }
  for (int i = tid; i < BM * BN; i += THREADS) {
    const int m = i / BN, n = i % BN, col = blockIdx.x * BN + n;
    if (m >= rows || col >= a.N) continue;
    float* c = a.C + size_t(a.crow ? a.crow[m0 + m] : m0 + m) * a.ldc + col;
    if (a.mode == GEMM_ADD) *c += cs[m * ld + n];
    else *c = cs[m * ld + n];
  }
}

template <typename T, int BM>
__global__ void __launch_bounds__(kGemmThreads) gemm_kernel(GemmArgs a) {
  using namespace nvcuda;
  constexpr bool kQ = is_qw<T>::value;
  constexpr bool kG = std::is_same_v<T, GB>;
  constexpr bool kWLo = !std::is_same_v<T, __nv_bfloat16>;  // weights need a low part
  constexpr int MF = BM / 16;                               // 16-row fragments per warp
  constexpr int kAV = BM * kGemmBK / 4 / kGemmThreads;      // float4 of A per thread and k-step
  constexpr int kWE = kQ || kG ? 8 : 16 / int(sizeof(T));  // weight elements per load (quantised: 8 codes)
  constexpr int kWV = kGemmBN * kGemmBK / kWE / kGemmThreads;
  constexpr bool kF8 = std::is_same_v<T, F8W>;
  constexpr int kGemmWarps = kGemmThreads / 32;
  struct Tiles {
    __nv_bfloat16 ah[BM][kGemmLd], al[BM][kGemmLd], wh[kGemmBN][kGemmLd], wl[kWLo ? kGemmBN : 1][kGemmLd];
    __nv_bfloat16 am[kF8 ? BM : 1][kGemmLd];       // F8W exact: the activations' middle part
    float f8[kF8 ? kGemmWarps : 1][2][kF8 ? 256 : 1];  // F8W per-row scales: a warp's block sums and totals
  };
  constexpr int kCLd = kGemmBN + 4;
  constexpr size_t kSmem = sizeof(Tiles) > size_t(BM) * kCLd * 4 ? sizeof(Tiles) : size_t(BM) * kCLd * 4;
  __shared__ __align__(128) unsigned char smem[kSmem];
  Tiles& s = *reinterpret_cast<Tiles*>(smem);
  float* cs = reinterpret_cast<float*>(smem);  // [BM][kCLd], after the k loop

  int m0, m1;
  const void* W;
  if (a.tiles) {
    if (int(blockIdx.y) >= *a.ntiles) return;
    const int* tl = a.tiles + 3 * blockIdx.y;
    W = a.wtab[tl[0]];
    m0 = tl[1];
    m1 = tl[2];
  } else {
    W = a.W;
    m0 = blockIdx.y * BM;
    m1 = min(a.M, m0 + BM);
  }
  if (a.mode == GEMM_SWIGLU ? int(blockIdx.x) * (kGemmBN / 2) >= a.half : int(blockIdx.x) * kGemmBN >= a.N) return;
  const int tid = threadIdx.x, warp = tid >> 5;

  // This thread's global sources: A rows (gathered) and weight rows.
  const float* ap[kAV];
  int ac[kAV];
#pragma unroll
  for (int u = 0; u < kAV; ++u) {
    const int f = tid + u * kGemmThreads, r = f / (kGemmBK / 4), m = m0 + r;
    ac[u] = (f % (kGemmBK / 4)) * 4;
    ap[u] = m < m1 ? a.A + size_t(a.arow ? a.arow[m] : m) * a.lda : nullptr;
  }
  const uint8_t* wp[kWV];  // row starts (bytes)
  const __nv_bfloat16 *wsc[kWV], *wbi[kWV];  // quantised: the row's scales and biases
  const float* wfs[kWV];  // FP8: the row's block scales
  int wc[kWV], wk[kWV];  // GGUF: the row's block kind
#pragma unroll
  for (int u = 0; u < kWV; ++u) {
    const int f = tid + u * kGemmThreads, n = f / (kGemmBK / kWE);
    wc[u] = (f % (kGemmBK / kWE)) * kWE;
    bool ok;
    const int r = gemm_wrow(a, n, ok);
    const uint8_t* base = static_cast<const uint8_t*>(W);
    wp[u] = nullptr;
    if (!ok) continue;
    if constexpr (kG) {
      wp[u] = gmat_row(a.gm, W, a.K, r, wk[u]);
    } else if constexpr (std::is_same_v<T, F8W>) {
      const int p = r >= a.qsplit ? 1 : 0, rr = r - p * a.qsplit, nbc = (a.K + a.qgroup - 1) / a.qgroup;
      wp[u] = base + a.qw[p] + size_t(rr) * a.K;
      wfs[u] = reinterpret_cast<const float*>(base + a.qs[p]) + size_t(rr / a.qbrows) * nbc;
    } else if constexpr (kQ) {
      const int p = r >= a.qsplit ? 1 : 0, rr = r - p * a.qsplit, gpr = a.K / a.qgroup;
      wp[u] = base + a.qw[p] + size_t(rr) * (size_t(a.K) * T::bits / 8);
      wsc[u] = reinterpret_cast<const __nv_bfloat16*>(base + a.qs[p]) + size_t(rr) * gpr;
      wbi[u] = reinterpret_cast<const __nv_bfloat16*>(base + a.qb[p]) + size_t(rr) * gpr;
    } else {
      wp[u] = base + size_t(r) * a.K * sizeof(T);
    }
  }
  // F8W: codes as the weights (see the head of this file). uniform: the
  // warp's 16 rows share their scales, wscale the warp's scales row; else
  // rscale the scales row of the warp's row lane % 16, the one output
  // column this lane scales in the staging tile. Null past N.
  bool exact = false, uniform = false;
  const float *wscale = nullptr, *rscale = nullptr;
  if constexpr (kF8) {
    exact = a.qgroup % kGemmBK == 0;
    uniform = a.qbrows % 16 == 0 && a.qsplit % 16 == 0 && (a.mode != GEMM_SWIGLU || a.half % 16 == 0);
    const int nbc = (a.K + a.qgroup - 1) / a.qgroup;
    auto scales_row = [&](int n) -> const float* {
      bool ok;
      const int r = gemm_wrow(a, n, ok);
      if (!ok) return nullptr;
      const int p = r >= a.qsplit ? 1 : 0, rr = r - p * a.qsplit;
      return reinterpret_cast<const float*>(static_cast<const uint8_t*>(W) + a.qs[p]) + size_t(rr / a.qbrows) * nbc;
    };
    if (exact && uniform) wscale = scales_row(warp * 16);
    if (exact && !uniform) rscale = scales_row(warp * 16 + (tid & 15));
  }
  float4 av[kAV];
  uint4 wv[kWV];
  float ws[kWV], wb[kWV];  // quantised: the group's scale and bias
  float wf[kG ? kWV : 1][8];  // GGUF: the 8 weights, expanded
  auto load = [&](int k0) {
#pragma unroll
    for (int u = 0; u < kAV; ++u)
      av[u] = ap[u] && k0 + ac[u] < a.K ? *reinterpret_cast<const float4*>(ap[u] + k0 + ac[u])
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int u = 0; u < kWV; ++u) {
      const int c = k0 + wc[u];
      wv[u] = make_uint4(0, 0, 0, 0);
      if (!wp[u] || c >= a.K) {
        ws[u] = wb[u] = 0.f;
        if constexpr (kG)
#pragma unroll
          for (int i = 0; i < 8; ++i) wf[u][i] = 0.f;
        continue;
      }
      if constexpr (kG) {
        gguf_weights8(wk[u], wp[u], c, wf[u]);
      } else if constexpr (std::is_same_v<T, F8W>) {
        const uint2 t = *reinterpret_cast<const uint2*>(wp[u] + c);
        wv[u].x = t.x;
        wv[u].y = t.y;
        ws[u] = wfs[u][c / a.qgroup];
        wb[u] = 0.f;
      } else if constexpr (kQ) {
        if constexpr (T::bits == 8) {
          const uint2 t = *reinterpret_cast<const uint2*>(wp[u] + c);
          wv[u].x = t.x;
          wv[u].y = t.y;
        } else {
          wv[u].x = *reinterpret_cast<const uint32_t*>(wp[u] + c / 2);
        }
        ws[u] = __bfloat162float(wsc[u][c / a.qgroup]);
        wb[u] = __bfloat162float(wbi[u][c / a.qgroup]);
      } else {
        wv[u] = *reinterpret_cast<const uint4*>(wp[u] + size_t(c) * sizeof(T));
      }
    }
  };
  auto store = [&]() {
#pragma unroll
    for (int u = 0; u < kAV; ++u) {
      const int f = tid + u * kGemmThreads, r = f / (kGemmBK / 4);
      const float v[4] = {av[u].x, av[u].y, av[u].z, av[u].w};
      if (kF8 && exact) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // hi, then the exact remainder as mid and lo
          const __nv_bfloat16 hi = __float2bfloat16_rn(v[i]);
          s.ah[r][ac[u] + i] = hi;
          split_bf16(v[i] - __bfloat162float(hi), s.am[kF8 ? r : 0][ac[u] + i], s.al[r][ac[u] + i]);
        }
        continue;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) split_bf16(v[i], s.ah[r][ac[u] + i], s.al[r][ac[u] + i]);
    }
#pragma unroll
    for (int u = 0; u < kWV; ++u) {
      const int f = tid + u * kGemmThreads, n = f / (kGemmBK / kWE);
      if constexpr (kG) {
#pragma unroll
        for (int i = 0; i < 8; ++i) split_bf16(wf[u][i], s.wh[n][wc[u] + i], s.wl[n][wc[u] + i]);
      } else if constexpr (std::is_same_v<T, F8W>) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t q = ((i < 4 ? wv[u].x : wv[u].y) >> (8 * (i % 4))) & 0xffu;
          if (exact) {
            s.wh[n][wc[u] + i] = __float2bfloat16_rn(gemm_e4m3(q));  // exact; no low part read
          } else {
            split_bf16(gemm_e4m3(q) * ws[u], s.wh[n][wc[u] + i], s.wl[n][wc[u] + i]);
          }
        }
      } else if constexpr (kQ) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          uint32_t q;
          if constexpr (T::bits == 8) q = ((i < 4 ? wv[u].x : wv[u].y) >> (8 * (i % 4))) & 0xffu;
          else q = (wv[u].x >> (4 * i)) & 0xfu;  // lowest nibble first
          split_bf16(fmaf(float(q), ws[u], wb[u]), s.wh[n][wc[u] + i], s.wl[n][wc[u] + i]);
        }
      } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        *reinterpret_cast<uint4*>(&s.wh[n][wc[u]]) = wv[u];
      } else {
        const T* e = reinterpret_cast<const T*>(&wv[u]);
#pragma unroll
        for (int i = 0; i < kWE; ++i) split_bf16(to_f<T>(e[i]), s.wh[n][wc[u] + i], s.wl[kWLo ? n : 0][wc[u] + i]);
      }
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MF], blk[kF8 ? MF : 1];
#pragma unroll
  for (int i = 0; i < MF; ++i) wmma::fill_fragment(acc[i], 0.0f);
  if constexpr (kF8)
#pragma unroll
    for (int i = 0; i < MF; ++i) wmma::fill_fragment(blk[i], 0.0f);
  load(0);
  for (int k0 = 0; k0 < a.K; k0 += kGemmBK) {
    store();
    __syncthreads();
    if (k0 + kGemmBK < a.K) load(k0 + kGemmBK);  // in flight while this tile is multiplied
    if (kF8 && exact) {  // codes times activations into the block's sums
#pragma unroll
      for (int kk = 0; kk < kGemmBK; kk += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bh;
        wmma::load_matrix_sync(bh, &s.wh[warp * 16][kk], kGemmLd);
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> ah, am, al;
          wmma::load_matrix_sync(al, &s.al[i * 16][kk], kGemmLd);
          wmma::mma_sync(blk[kF8 ? i : 0], al, bh, blk[kF8 ? i : 0]);  // the small terms first
          wmma::load_matrix_sync(am, &s.am[kF8 ? i * 16 : 0][kk], kGemmLd);
          wmma::mma_sync(blk[kF8 ? i : 0], am, bh, blk[kF8 ? i : 0]);
          wmma::load_matrix_sync(ah, &s.ah[i * 16][kk], kGemmLd);
          wmma::mma_sync(blk[kF8 ? i : 0], ah, bh, blk[kF8 ? i : 0]);
        }
      }
      if ((k0 + kGemmBK) % a.qgroup == 0 || k0 + kGemmBK >= a.K) {  // the block ends: its scale on its sums
        const int b = k0 / a.qgroup;
        if (uniform) {
          const float sc = wscale ? __ldg(wscale + b) : 0.f;
#pragma unroll
          for (int i = 0; i < MF; ++i) {
#pragma unroll
            for (int e = 0; e < acc[i].num_elements; ++e) acc[i].x[e] = fmaf(sc, blk[kF8 ? i : 0].x[e], acc[i].x[e]);
            wmma::fill_fragment(blk[kF8 ? i : 0], 0.0f);
          }
        } else {  // per-row scales: lane l scales output column l % 16 of the warp's tile
          const float sc = rscale ? __ldg(rscale + b) : 0.f;
          float* sums = s.f8[kF8 ? warp : 0][0];
          float* tot = s.f8[kF8 ? warp : 0][1];
#pragma unroll
          for (int i = 0; i < MF; ++i) {
            wmma::store_matrix_sync(sums, blk[kF8 ? i : 0], 16, wmma::mem_row_major);
            wmma::store_matrix_sync(tot, acc[i], 16, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int q = 0; q < 8; ++q) {  // element j's column j % 16 is lane % 16
              const int j = (tid & 31) + 32 * q;
              tot[j] = fmaf(sc, sums[j], tot[j]);
            }
            __syncwarp();
            wmma::load_matrix_sync(acc[i], tot, 16, wmma::mem_row_major);
            wmma::fill_fragment(blk[kF8 ? i : 0], 0.0f);
            __syncwarp();
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kGemmBK; kk += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bh, bl;
        wmma::load_matrix_sync(bh, &s.wh[warp * 16][kk], kGemmLd);
        if constexpr (kWLo) wmma::load_matrix_sync(bl, &s.wl[warp * 16][kk], kGemmLd);
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> ah, al;
          wmma::load_matrix_sync(ah, &s.ah[i * 16][kk], kGemmLd);
          wmma::load_matrix_sync(al, &s.al[i * 16][kk], kGemmLd);
          wmma::mma_sync(acc[i], al, bh, acc[i]);  // the small terms first
          if constexpr (kWLo) wmma::mma_sync(acc[i], ah, bl, acc[i]);
          wmma::mma_sync(acc[i], ah, bh, acc[i]);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < MF; ++i)
    wmma::store_matrix_sync(cs + (i * 16) * kCLd + warp * 16, acc[i], kCLd, wmma::mem_row_major);
  __syncthreads();
  gemm_epilogue<BM, kGemmBN, kGemmThreads>(a, cs, kCLd, m0, m1 - m0);
}

}  // namespace flashmoe::cuda
