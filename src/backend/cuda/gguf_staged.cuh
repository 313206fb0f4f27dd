// The decode step's GGUF kernels with the weights staged through shared
// memory: a warp copies whole runs of rows (raw blocks, any kind) into its
// own shared-memory buffer with 16-byte cp.async copies, all of a run in
// flight at once and the next run's copies issued before the current one is
// decoded, then decodes from shared memory with gguf_lane_row_dot (the
// block-per-warp readers for Q4_K / Q6_K, 8 columns a lane for the others).
// Why: the direct readers (gguf_kernels.cuh) keep 4 bytes a lane in flight
// per block and wait for each block before the next row, so the 35B shape
// ran at 300-400 GB/s; a staged run is one round of loads for several
// kilobytes, and the copies need no registers. Runs are consecutive rows,
// so a run is one contiguous byte range; it is copied rounded out to 16-byte
// boundaries, which stay inside the matrix (upload.cu starts every part,
// and every expert's blocks, on a 16-byte boundary and pads its end to one).
#pragma once
#include <algorithm>

#include "backend/cuda/gguf_kernels.cuh"

namespace flashmoe::cuda {

// The warp copies bytes [src, src + n) into dst (16-byte aligned shared
// memory), rounded out to 16-byte boundaries; returns where src's first byte
// landed in dst (0..15). dst needs n + 30 bytes.
__device__ __forceinline__ int warp_stage(const void* src, size_t n, uint8_t* dst, int lane) {
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t a = s & ~uintptr_t(15), e = (s + n + 15) & ~uintptr_t(15);
  for (uintptr_t p = a + 16 * uintptr_t(lane); p < e; p += 32 * 16)
    cp_async16(dst + (p - a), reinterpret_cast<const void*>(p));
  return int(s - a);
}

// Bytes a run of n rows of row bytes rb needs in a stage buffer.
FM_HD int gstage_need(int n, size_t rb) { return int((size_t(n) * rb + 30 + 15) / 16 * 16); }

// How a matrix is cut into runs: S bytes per stage buffer (two per warp),
// R[i] rows per run in part i (the host's gstage_plan).
struct GStage {
  int S = 0;
  int R[kGParts] = {};
};

// The run u of g (runs of a part never cross into the next one): its part,
// first row and row count; false past the last run.
__device__ __forceinline__ bool gstage_run(const GMat& g, const GStage& st, int u, int& part, int& r0, int& n) {
  for (int i = 0; i < g.n; ++i) {
    const int rows = g.row0[i + 1] - g.row0[i], runs = (rows + st.R[i] - 1) / st.R[i];
    if (u < runs) {
      part = i;
      r0 = g.row0[i] + u * st.R[i];
      n = min(st.R[i], g.row0[i + 1] - r0);
      return true;
    }
    u -= runs;
  }
  return false;
}

// One staged run: where its bytes are in a warp's buffer.
struct GRun {
  int part = 0, r0 = 0, n = 0, at = 0;
};

// Stage run u of g (rows of cols columns at base W) into buf; n = 0 when
// there is none. Commits a copy group either way (the wait counts stay
// uniform).
__device__ __forceinline__ GRun gstage_issue(const void* W, const GMat& g, const GStage& st, int cols, int u,
                                             uint8_t* buf, int lane) {
  GRun r;
  if (u >= 0 && gstage_run(g, st, u, r.part, r.r0, r.n)) {
    const size_t rb = gguf_row_bytes(g.kind[r.part], cols);
    const uint8_t* src = static_cast<const uint8_t*>(W) + g.off[r.part] + size_t(r.r0 - g.row0[r.part]) * rb;
    r.at = warp_stage(src, size_t(r.n) * rb, buf, lane);
  } else {
    r.n = 0;
  }
  cp_async_commit();
  return r;
}

// y[r] (+)= W[r,:] . norm(x) (norm skipped when nw is null). Warp w takes
// runs w, w + (all warps), ...; two runs staged ahead, the first two before
// the wait (weights do not depend on the kernel before). Shared memory: x
// (cols floats), then two stage buffers of st.S bytes per warp.
static __global__ void __launch_bounds__(kThreads, 4) gmatvec_staged_kernel(const void* __restrict__ W, GMat g,
                                                                         GStage st, int cols,
                                                                         const float* __restrict__ x,
                                                                         const float* __restrict__ nw, float eps,
                                                                         float* __restrict__ y, int accumulate,
                                                                         float* __restrict__ xcopy) {
  extern __shared__ __align__(16) uint8_t gsm[];
  float* xs = reinterpret_cast<float*>(gsm);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* const buf = gsm + (size_t(cols) * 4 + 15) / 16 * 16 + size_t(warp) * 2 * st.S;  // two of st.S
  const int step = gridDim.x * kWarps;
  int u = blockIdx.x * kWarps + warp;
  GRun cur = gstage_issue(W, g, st, cols, u, buf, lane);
  GRun nxt = gstage_issue(W, g, st, cols, u + step, buf + st.S, lane);
  NormPre pre;
  norm_preload(nw, cols, true, pre);
  pdl_wait();
  pdl_trigger();
  // The layer's input residual, kept for a folded router (outproj_router_kernel).
  if (xcopy && blockIdx.x == gridDim.x - 1)
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xcopy[i] = x[i];
  load_x(x, nw, eps, cols, xs, &pre);
  for (int b = 0; cur.n; b ^= 1, u += step) {
    cp_async_wait<1>();
    __syncwarp();
    uint8_t* const from = buf + b * st.S;
    const int kind = g.kind[cur.part];
    const size_t rb = gguf_row_bytes(kind, cols);
    for (int i = 0; i < cur.n; ++i) {
      const float d = warp_sum(gguf_lane_row_dot(kind, from + cur.at + size_t(i) * rb, xs, cols, lane));
      const int r = cur.r0 + i;
      if (lane == 0) y[r] = accumulate ? y[r] + d : d;
    }
    __syncwarp();
    cur = nxt;
    nxt = gstage_issue(W, g, st, cols, u + 2 * step, from, lane);
  }
  cp_async_wait<0>();
}

// h[j][r] = silu(gate_j[r] . xn) * (up_j[r] . xn); blockIdx.y = slot j (j
// == k: the shared expert). Routed blocks pick the experts themselves from
// the router's logits (a.logits; a warp's work, every block at once) instead
// of waiting for a top-k kernel; block (0,0) publishes ids, weights and the
// rows' pointers for down (as gate_up_kernel). Warp rows grid-stride; a
// row's gate and up rows are staged together (S bytes a buffer, two a warp).
static __global__ void __launch_bounds__(kThreads, 4) ggate_up_staged_kernel(MoeArgs a, GExperts ge, int S) {
  extern __shared__ __align__(16) uint8_t gsm[];
  float* xs = reinterpret_cast<float*>(gsm);
  const int j = blockIdx.y;
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  if (int(blockIdx.x) * kWarps >= I) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* buf[2];
  buf[0] = gsm + (size_t(a.H) * 4 + 15) / 16 * 16 + size_t(warp) * 2 * S;
  buf[1] = buf[0] + S;
  const GMat& g = shared ? ge.sgu : ge.gu;
  const int step = gridDim.x * kWarps;
  // Stage row r's gate and up rows into dst (one copy group); offsets of both.
  auto issue = [&](const void* B, int r, uint8_t* dst, int& ag, int& au, int& kg, int& ku) {
    if (r < I) {
      const uint8_t* gr = gmat_row(g, B, a.H, r, kg);
      const uint8_t* ur = gmat_row(g, B, a.H, I + r, ku);
      const int ng = gstage_need(1, gguf_row_bytes(kg, a.H));
      ag = warp_stage(gr, gguf_row_bytes(kg, a.H), dst, lane);
      au = ng + warp_stage(ur, gguf_row_bytes(ku, a.H), dst + ng, lane);
    }
    cp_async_commit();
  };
  int r = blockIdx.x * kWarps + warp;
  // Rows r, r + step, ... alternate between the two buffers; each buffer's
  // offsets and kinds in scalars (an array indexed by the buffer would live
  // in local memory).
  int ag0 = 0, au0 = 0, kg0 = 0, ku0 = 0, ag1 = 0, au1 = 0, kg1 = 0, ku1 = 0;
  const void* B = nullptr;
  if (shared) {  // its rows are known before the wait
    B = a.s_gu;
    issue(B, r, buf[0], ag0, au0, kg0, ku0);
    issue(B, r + step, buf[1], ag1, au1, kg1, ku1);
  } else if (a.logits && warp == 0) {
    prefetch_tables(a.tsel, a.E);
  }
  NormPre pre;
  norm_preload(a.norm_w, a.H, true, pre);
  pdl_wait();
  pdl_trigger();
  // Routed slots: the pick, then the rows' copies, then the norm of x (the
  // copies in flight while it runs).
  if (!shared) {
    if (a.logits) {
      B = pick_block_expert(a, j, 1.0f);
    } else {
      B = a.sel ? a.sel[j] : a.gu_tab[a.ids[j]];
    }
    issue(B, r, buf[0], ag0, au0, kg0, ku0);
    issue(B, r + step, buf[1], ag1, au1, kg1, ku1);
  }
  load_x(a.x, a.norm_w, a.eps, a.H, xs, &pre);
  // Row r from dst, then row r + 2 step staged into it.
  auto row = [&](uint8_t* dst, int& ag, int& au, int& kg, int& ku) {
    cp_async_wait<1>();
    __syncwarp();
    const float gv = warp_sum(gguf_lane_row_dot(kg, dst + ag, xs, a.H, lane));
    const float uv = warp_sum(gguf_lane_row_dot(ku, dst + au, xs, a.H, lane));
    if (lane == 0) a.hb[j * a.maxI + r] = siluf_(gv) * uv;
    __syncwarp();
    issue(B, r + 2 * step, dst, ag, au, kg, ku);
    r += step;
  };
  while (r < I) {
    row(buf[0], ag0, au0, kg0, ku0);
    if (r >= I) break;
    row(buf[1], ag1, au1, kg1, ku1);
  }
  cp_async_wait<0>();
}

// x[r0 .. r0 + R) += sum_j w_j * down_j[r] . h_j: a block per R consecutive
// rows, a warp per slot (the shared expert's slot k last), each warp's R
// rows staged in one run (S bytes of shared memory a warp; the shared
// expert's before the wait); slots summed in slot order (down_slots_sum).
template <int R>
__global__ void __launch_bounds__(kDownSlotsMax * 32) gdown_staged_kernel(MoeArgs a, GExperts ge, int S) {
  extern __shared__ __align__(16) uint8_t gsm[];
  __shared__ float part[kDownSlotsMax][R];
  const int j = threadIdx.x >> 5, lane = threadIdx.x & 31, slots = blockDim.x >> 5;
  const int r0 = blockIdx.x * R, n = min(R, a.H - r0);
  const bool shared = j == a.k;
  const int I = shared ? a.Is : a.I;
  const GMat& g = shared ? ge.sdn : ge.dn;
  uint8_t* buf = gsm + size_t(j) * S;
  int kd = 0, at = 0;
  auto issue = [&](const void* B) {
    const uint8_t* row = gmat_row(g, B, I, r0, kd);
    at = warp_stage(row, size_t(n) * gguf_row_bytes(kd, I), buf, lane);
    cp_async_commit();
  };
  if (shared) issue(a.s_down);
  pdl_wait();
  pdl_trigger();
  if (!shared) issue(a.sel ? a.sel[a.k + j] : a.down_tab[a.ids[j]]);
  cp_async_wait<0>();
  __syncwarp();
  const size_t rb = gguf_row_bytes(kd, I);
  const float* h = a.hb + j * a.maxI;
  float d[R];
#pragma unroll
  for (int i = 0; i < R; ++i) d[i] = i < n ? gguf_lane_row_dot(kd, buf + at + size_t(i) * rb, h, I, lane) : 0.f;
  down_slots_sum<R>(d, a.w[j], part, j, lane, slots, n, a.x + r0);
}

// ------------------------------------------------------------------ host side

// Stage buffers hold runs of about kStageBytes (at least one row): enough
// bytes in flight per warp (two runs) for the HBM at 4 resident blocks per SM.
constexpr int kStageBytes = 2048;
// The most rows per run of the down kernel's warps (a block per 1, 2, 4 or
// kDownRun rows: gdown_rows).
constexpr int kDownRun = 8;

// How gmatvec_staged_kernel cuts g (rows of cols columns) into runs: up to
// kStageBytes a run, but no more rows a run than leave every one of `warps`
// warps a run (a warp decodes its runs one after another: on a small
// matrix long runs left most SMs idle; round 1 of session 6).
inline GStage gstage_plan(const GMat& g, int cols, int warps) {
  GStage st;
  const int rows = g.n ? g.row0[g.n] : 0, share = std::max(1, rows / std::max(1, warps));
  for (int i = 0; i < g.n; ++i) {
    const size_t rb = gguf_row_bytes(g.kind[i], cols);
    st.R[i] = std::clamp(int(kStageBytes / rb), 1, share);
    st.S = std::max(st.S, gstage_need(st.R[i], rb));
  }
  return st;
}
// Rows per block of gdown_staged_kernel: the fewest of 1, 2, 4, kDownRun
// whose grid of H rows fits one resident wave (resident(R): blocks), so that
// each warp decodes as few rows one after another as the wave allows.
template <typename F>
int gdown_rows(int H, F resident) {
  for (int R : {1, 2, 4})
    if ((H + R - 1) / R <= resident(R)) return R;
  return kDownRun;
}
// gmatvec_staged_kernel's shared memory: x, then two buffers a warp.
inline size_t gmatvec_staged_smem(const GStage& st, int cols) {
  return (size_t(cols) * 4 + 15) / 16 * 16 + size_t(kWarps) * 2 * size_t(st.S);
}

// The staged expert kernels' buffer bytes per warp (gate_up: one row's gate
// and up rows; down: kDownRun rows), over the routed experts (k > 0) and the
// shared expert / dense MLP (has_shared).
inline int ggate_up_stage_bytes(const GExperts& ge, int H, int k, bool has_shared) {
  int S = 0;
  auto add = [&](const GMat& g) {
    int s = 0;
    for (int i = 0; i < g.n; ++i) s = std::max(s, gstage_need(1, gguf_row_bytes(g.kind[i], H)));
    S = std::max(S, 2 * s);
  };
  if (k > 0) add(ge.gu);
  if (has_shared) add(ge.sgu);
  return S;
}
inline int gdown_stage_bytes(const GExperts& ge, int I, int Is, int k, bool has_shared) {
  int S = 0;
  if (k > 0) S = gstage_need(kDownRun, gguf_row_bytes(ge.dn.kind[0], I));
  if (has_shared) S = std::max(S, gstage_need(kDownRun, gguf_row_bytes(ge.sdn.kind[0], Is)));
  return S;
}

}  // namespace flashmoe::cuda
