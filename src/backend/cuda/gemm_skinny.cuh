// The dense products of a few rows (a batched decode step: T <= 64 tokens)
// over bf16 weights: C[T][N] (=, +=, swiglu) = A[T][K] . W^T, and the
// routed experts' products over tiles of a few of an expert's rows.
//
// At T = 32 the tiled products (gemm_pipe_kernel: 128 weight rows by T
// tokens per block, the whole K) gave the 35B's out-proj (2,048 rows) 16
// blocks on 132 SMs: ~0.3 TB/s. Here K is split over a cluster of up to 8
// blocks so that even 2,048 rows fill the GPU; the blocks' partial tiles
// are summed through distributed shared memory in rank order
// (deterministic), each block writing a share of the outputs (store, add
// or swiglu as gemm_epilogue).
//  - A block streams its 128 weight rows once through shared memory:
//    cp.async stages of 64 columns of the weights (16 KB) and of its
//    tokens' activations, 3-5 stages deep, 2 blocks an SM. Session 20
//    measured this against the kernel before it, which held the next 64
//    columns of weights in registers (a double buffer of 64 registers that
//    spilled at T = 32): the 35B's B = 8 step +18%, B = 32 +10%, B = 64
//    +7% (bench/NOTES-cuda.md, session 20).
//  - The tensor cores with the weights as the 16-row operand and the tokens
//    as the 8-column one (mma m16n8k16, one 8-token tile per 8 rows of T).
//  - A lane's 16 bytes (8 consecutive columns of one weight row) feed two
//    mma k-steps: the order of k inside the dot products is permuted, the
//    same way for the weights and the activations, so the activation
//    operand is also 8 consecutive columns of one token, split into hi/lo
//    bf16 (gemm.cuh's precision scheme). Where the kernel before left them
//    split (a.Ahi / a.Alo: the norms, the combine, a swiglu product's
//    epilogue) the block stages those; else it stages the fp32 rows and
//    splits them at use. The same bits either way; reading the split rows
//    made the 35B's B = 32 step 0.8-1.0% faster (session 17).
#pragma once
#include <cooperative_groups.h>

#include <atomic>
#include <type_traits>

#include "backend/cuda/gemm.cuh"

namespace flashmoe::cuda {

constexpr int kSkinnyWarps = 4;                 // warps along the weight rows
constexpr int kSkinnyRows = 32 * kSkinnyWarps;  // weight rows per block: 32 per warp (two 16-row mma tiles)
// Warps along K inside a block: K group kw takes the 32 columns at 32 kw of
// each 64-column stage, and the groups' partial tiles are summed in shared
// memory in a fixed order. At 32 rows a block of one group left the SMs at
// ~4 warps each on the 35B's out-proj (16 blocks of 128 rows, K split over
// 8): too few loads in flight.
constexpr int kSkinnyKWarps = 2;
constexpr int kSkinnyThreads = 32 * kSkinnyWarps * kSkinnyKWarps;
constexpr int kSkinnyMaxSplit = 8;  // blocks per cluster along K (the portable cluster size)
constexpr int kSkinnyMaxRows = 64;  // tokens (8 tiles of 8)
// The routed experts (grouped): rows per tile of an expert's token list
// (route_lists_kernel's BM), and the mean rows per picked expert, T * k / E,
// up to which the default takes this kernel for them (the 35B's B = 64:
// 2.0; measured faster there and at B = 8 and 32 than the tiled product and
// few_rows_kernel, session 20). Tiles of 8 rows (one 8-token mma tile): at
// ~1-2 rows an expert, 16 only doubled the padded arithmetic and staging
// (B = 32 +2.2%, B = 64 +1.5% against 16, session 20).
constexpr int kSkinnyExpertRows = 8;
constexpr double kSkinnyExpertMean = 2.0;

// The shared memory of skinny_gemm_kernel<NT, ...>: kStages stages of
// kStage bytes (64 columns of the block's weight rows, then of its TP
// tokens' activations: hi + lo bf16 or fp32, 4 bytes a column either way),
// then, once the stages are done, the partial sums [TP][kSkinnyRows + 4].
// Stages: as deep as 2 blocks an SM allow (measured on the 35B, session
// 20: at NT <= 2, 5 stages against 4 +0.3%, against 3 with 3 blocks an SM
// +2.5%; at NT = 4, 4 stages 2 blocks +4.8% against 3 stages 3 blocks).
template <int NT>
struct SkinnyShape {
  static constexpr int TP = 8 * NT;
  static constexpr int kW = kSkinnyRows * 64 * 2;
  static constexpr int kA = TP * 64 * 4;
  static constexpr int kStage = kW + kA;
  static constexpr int kStages = NT <= 2 ? 5 : NT == 4 ? 4 : 3;
  static constexpr int kPart = TP * (kSkinnyRows + 4) * 4;
  static constexpr size_t kSmem = size_t(kStage * kStages > kPart ? kStage * kStages : kPart);
  static_assert(2 * (kSmem + 1024) <= 228 * 1024, "two blocks an SM");
};

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

// The block's partial sums part[token][local weight row] summed over the
// cluster's K split in rank order (distributed shared memory), each block
// storing a share of the outputs (store, add, or swiglu with its split).
template <int LD>
__device__ __forceinline__ void skinny_store(const GemmArgs& a, float (*part)[LD], int split, int rank, int m0,
                                             int rows) {
  constexpr int HB = kSkinnyRows / 2, NTH = kSkinnyThreads;
  const int tid = int(threadIdx.x);
  const bool swiglu = a.mode == GEMM_SWIGLU;
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

// Dense: a.M <= 8 * NT rows of a.A (fp32, row stride a.lda), K % 8 == 0,
// 16-byte aligned rows. Grid: x = the K split (one cluster), y = blocks of
// kSkinnyRows weight rows (swiglu: half gate rows, half the up rows that
// pair with them); kslice: columns per block, a multiple of 32.
// Grouped (a.tiles: the routed experts): z = the tile, rows [first, end)
// (at most 8 * NT) of the expert's weights a.wtab[group], A rows gathered
// through a.arow, C rows scattered through a.crow (each where not null).
// PS: the activations come split (a.Ahi / a.Alo, bf16 rows of stride
// a.lda, lda % 8 == 0). Rows of 16-byte chunks in shared memory are
// XOR-swizzled so that a quarter-warp's two rows fall in different banks.
template <int NT, bool PS>
__global__ void __launch_bounds__(kSkinnyThreads, 2) skinny_gemm_kernel(GemmArgs a, int kslice) {
  using S = SkinnyShape<NT>;
  constexpr int ST = S::kStages;
  constexpr int TP = S::TP, LD = kSkinnyRows + 4, HB = kSkinnyRows / 2, NTH = kSkinnyThreads;
  static_assert(kSkinnyKWarps == 2, "K group kw takes the 32 columns at 32 kw of each 64-column stage");
  extern __shared__ __align__(128) unsigned char smem[];
  const int split = int(gridDim.x), rank = int(blockIdx.x);
  const int tid = int(threadIdx.x), warp = (tid >> 5) % kSkinnyWarps, kw = (tid >> 5) / kSkinnyWarps;
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bool swiglu = a.mode == GEMM_SWIGLU;
  const __nv_bfloat16* W;
  int m0 = 0, rows = a.M;
  // Grouped, a.tile_wait > 0 (down after gate/up): the kernel before is
  // this tile's producer, which passed its own wait before letting this one
  // start, so the tile list is final; the tile's count says when its rows
  // are in (the weights load before that).
  const bool tile_waits = a.tiles && a.tile_done && a.tile_wait > 0;
  if (a.tiles) {
    if (!tile_waits) pdl_wait();
    pdl_trigger();
    if (int(blockIdx.z) >= *a.ntiles) return;
    const int* tl = a.tiles + 3 * blockIdx.z;
    W = static_cast<const __nv_bfloat16*>(a.wtab[tl[0]]);
    m0 = tl[1];
    rows = tl[2] - tl[1];
  } else {
    W = static_cast<const __nv_bfloat16*>(a.W);
  }
  // This thread's copies per stage: weight rows n = tid / 8 + 32 u, chunk tid % 8.
  constexpr int kWPer = kSkinnyRows * 8 / NTH;
  int wsrc[kWPer];  // element offset of weight row n in W (skinny_weights_fit); -1: none
#pragma unroll
  for (int u = 0; u < kWPer; ++u) {
    const int n = tid / 8 + 32 * u;
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
    wsrc[u] = ok ? r * a.K : -1;
  }
  // Activation chunks: PS: hi rows then lo rows, 8 chunks a token; else 16 a token (fp32).
  constexpr int kAChunks = TP * 16, kAPer = (kAChunks + NTH - 1) / NTH;
  // (32 bits: at most 64 rows of activations, or a step's T * k expert rows.)
  int asrc[kAPer];  // element offset of the chunk's token row in A (or Ahi / Alo); -1: none
#pragma unroll
  for (int u = 0; u < kAPer; ++u) {
    const int f = tid + u * NTH;
    const int m = PS ? (f / 8) % TP : f / 16;
    asrc[u] = f < kAChunks && m < rows ? (a.arow ? a.arow[m0 + m] : m0 + m) * a.lda : -1;
  }
  const int k0 = rank * kslice, k1 = min(a.K, k0 + kslice);
  const int nst = k1 > k0 ? (k1 - k0 + 63) / 64 : 0;
  auto stage_w = [&](int s) { return reinterpret_cast<uint4*>(smem + size_t(s) * S::kStage); };
  auto stage_a = [&](int s) { return reinterpret_cast<uint4*>(smem + size_t(s) * S::kStage + S::kW); };
  // 16-byte chunk q of row r: bf16 rows hold 8 chunks, fp32 rows 16.
  auto sw8 = [](int r, int q) { return r * 8 + (q ^ ((r & 1) << 2)); };
  auto sw16 = [](int r, int q) { return r * 16 + (q ^ (r & 1)); };
  auto issue_w = [&](int st) {
    if (st >= nst) return;
    uint4* d = stage_w(st % ST);
    const int q = tid % 8, col = k0 + 64 * st + 8 * q;
#pragma unroll
    for (int u = 0; u < kWPer; ++u) {
      const bool ok = wsrc[u] >= 0 && col < k1;
      cp_async16(d + sw8(tid / 8 + 32 * u, q), ok ? W + wsrc[u] + col : W, ok);
    }
  };
  auto issue_a = [&](int st) {
    if (st < nst) {
      uint4* d = stage_a(st % ST);
#pragma unroll
      for (int u = 0; u < kAPer; ++u) {
        const int f = tid + u * NTH;
        if (f >= kAChunks) continue;
        if constexpr (PS) {
          const int lohi = f / (8 * TP), m = (f / 8) % TP, q = f % 8, col = k0 + 64 * st + 8 * q;
          const bool ok = asrc[u] >= 0 && col < k1;
          const __nv_bfloat16* src = lohi ? a.Alo : a.Ahi;
          cp_async16(d + lohi * 8 * TP + sw8(m, q), ok ? src + asrc[u] + col : a.Ahi, ok);
        } else {
          const int m = f / 16, q = f % 16, col = k0 + 64 * st + 4 * q;
          const bool ok = asrc[u] >= 0 && col < k1;
          cp_async16(d + sw16(m, q), ok ? a.A + asrc[u] + col : a.A, ok);
        }
      }
    }
    cp_async_commit();  // an empty group past the end keeps the counting uniform
  };
  // Under PDL the first stages' weights load before the wait (nothing writes
  // them); they join the first stage's group.
  if (!a.tiles || tile_waits) {
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) issue_w(s);
    if (!a.tiles) {
      pdl_wait();
      pdl_trigger();
    } else {
      if (tid == 0) wait_count(a.tile_done + blockIdx.z, a.tile_wait);
      __syncthreads();
    }
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) issue_a(s);
  } else {
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
      issue_w(s);
      issue_a(s);
    }
  }
  float acc[2][NT][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
  for (int st = 0; st < nst; ++st) {
    cp_async_wait<ST - 2>();
    __syncthreads();
    issue_w(st + ST - 1);  // into the buffer every warp finished with
    issue_a(st + ST - 1);
    const uint4* sw = stage_w(st % ST);
    const uint4* sa = stage_a(st % ST);
    uint4 w[4];  // weight rows warp * 32 + g + 8 i, columns 32 kw + 8 t .. + 7
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = sw[sw8(warp * 32 + g + 8 * i, 4 * kw + t)];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int m = 8 * j + g;
      uint32_t hi[4], lo[4];
      if constexpr (PS) {
        const uint4 h = sa[sw8(m, 4 * kw + t)], l = sa[8 * TP + sw8(m, 4 * kw + t)];
        hi[0] = h.x, hi[1] = h.y, hi[2] = h.z, hi[3] = h.w;
        lo[0] = l.x, lo[1] = l.y, lo[2] = l.z, lo[3] = l.w;
      } else {
        const uint4 u0 = sa[sw16(m, 8 * kw + 2 * t)], u1 = sa[sw16(m, 8 * kw + 2 * t + 1)];
        const float4 x0 = *reinterpret_cast<const float4*>(&u0), x1 = *reinterpret_cast<const float4*>(&u1);
        skinny_split2(x0.x, x0.y, hi[0], lo[0]);
        skinny_split2(x0.z, x0.w, hi[1], lo[1]);
        skinny_split2(x1.x, x1.y, hi[2], lo[2]);
        skinny_split2(x1.z, x1.w, hi[3], lo[3]);
      }
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const uint32_t a0 = skinny_word(w[2 * mt], 2 * s), a1 = skinny_word(w[2 * mt + 1], 2 * s);
          const uint32_t a2 = skinny_word(w[2 * mt], 2 * s + 1), a3 = skinny_word(w[2 * mt + 1], 2 * s + 1);
          skinny_mma(acc[mt][j], a0, a1, a2, a3, lo[2 * s], lo[2 * s + 1]);  // the small terms first
          skinny_mma(acc[mt][j], a0, a1, a2, a3, hi[2 * s], hi[2 * s + 1]);
        }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free: the partial sums take their place
  float(*part)[LD] = reinterpret_cast<float(*)[LD]>(smem);
  for (int q = kSkinnyKWarps - 1; q >= 0; --q) {
    if (kw == q) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& p = part[8 * j + 2 * t + (e & 1)][warp * 32 + mt * 16 + g + 8 * (e >> 1)];
            p = q == kSkinnyKWarps - 1 ? acc[mt][j][e] : p + acc[mt][j][e];
          }
    }
    if (q > 0) __syncthreads();
  }
  skinny_store(a, part, split, rank, m0, rows);
  if (a.tiles && a.tile_done && a.tile_wait == 0) {  // this block's share of the tile is stored
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(a.tile_done + blockIdx.z, 1);
  }
}

// Whether a weight matrix is small enough for the kernel: its offsets into
// W are 32-bit (fewer than 2^31 weights).
inline bool skinny_weights_fit(int64_t rows, int64_t cols) { return rows * cols < (int64_t(1) << 31); }

// Whether a's split activations can be read (given, in 16-byte aligned rows).
inline bool skinny_split_given(const GemmArgs& a) {
  return a.Ahi && a.Alo && a.lda % 8 == 0 && reinterpret_cast<uintptr_t>(a.Ahi) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.Alo) % 16 == 0;
}

// skinny_gemm_kernel<NT, PS>'s dynamic shared memory, allowed once per
// device (the attribute is the device's; up to 64 devices remembered).
template <int NT, bool PS>
inline cudaError_t skinny_allow_smem() {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (done.load(std::memory_order_acquire) & bit) return cudaSuccess;
  if (cudaError_t e = cudaFuncSetAttribute(skinny_gemm_kernel<NT, PS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(SkinnyShape<NT>::kSmem));
      e != cudaSuccess)
    return e;
  done.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

// The launch's grid on a device of `sms` SMs: K split over a cluster until
// there is a block for every SM, each block keeping at least 64 columns.
// (Until two blocks an SM, the in-projection at T = 32 took a split of 4
// in 1.5 waves instead of 2 in one: 0.7% slower at B = 32, 1.9% at B = 8;
// bench/NOTES-cuda.md, session 21.)
struct SkinnyGrid {
  int split = 1;   // blocks along K (a cluster)
  int blocks = 0;  // along the weight rows
  int kslice = 0;  // columns per block
};
inline SkinnyGrid skinny_grid(const GemmArgs& a, int sms, int ntiles) {
  SkinnyGrid g;
  g.blocks = a.mode == GEMM_SWIGLU ? (a.half + kSkinnyRows / 2 - 1) / (kSkinnyRows / 2)
                                   : (a.N + kSkinnyRows - 1) / kSkinnyRows;
  while (g.split < kSkinnyMaxSplit && int64_t(g.blocks) * ntiles * g.split < int64_t(sms) &&
         a.K >= 2 * 64 * g.split)
    g.split *= 2;
  g.kslice = ((a.K + 31) / 32 + g.split - 1) / g.split * 32;
  return g;
}

// skinny_gemm_kernel over a (see the kernel; dense: a.M <= kSkinnyMaxRows;
// grouped: up to `ntiles` tiles of at most `tile_rows` <= kSkinnyMaxRows
// rows; a weight matrix that skinny_weights_fit). The
// split activations are read where skinny_split_given, else a.A.
inline cudaError_t launch_skinny_gemm(const GemmArgs& a, int sms, cudaStream_t st, int ntiles = 1,
                                      int tile_rows = 0, bool pdl = false) {
  if (!a.tiles && !skinny_weights_fit(a.N, a.K)) return cudaErrorInvalidValue;
  const SkinnyGrid grid = skinny_grid(a, sms, ntiles);
  const int split = grid.split, blocks = grid.blocks, kslice = grid.kslice;
  const int M = a.tiles ? tile_rows : a.M;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(split), unsigned(blocks), unsigned(a.tiles ? ntiles : 1));
  cfg.blockDim = dim3(unsigned(kSkinnyThreads));
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
  auto go = [&](auto nt, auto ps) -> cudaError_t {
    constexpr int NT = decltype(nt)::value;
    constexpr bool PS = decltype(ps)::value;
    if (cudaError_t e = skinny_allow_smem<NT, PS>(); e != cudaSuccess) return e;
    cfg.dynamicSmemBytes = SkinnyShape<NT>::kSmem;
    return cudaLaunchKernelEx(&cfg, skinny_gemm_kernel<NT, PS>, a, kslice);
  };
  auto by_rows = [&](auto ps) {
    if (M <= 8) return go(std::integral_constant<int, 1>{}, ps);
    if (M <= 16) return go(std::integral_constant<int, 2>{}, ps);
    if (M <= 32) return go(std::integral_constant<int, 4>{}, ps);
    return go(std::integral_constant<int, 8>{}, ps);
  };
  return skinny_split_given(a) ? by_rows(std::true_type{}) : by_rows(std::false_type{});
}

}  // namespace flashmoe::cuda
