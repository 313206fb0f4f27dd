// How a warp of the FP8 decode kernels (fp8_matvec.cuh, fp8_router.cuh,
// fp8_experts.cuh) streams a tile's codes into the mma (fp8_mma.cuh).
//
// A lane copies all its steps of a range (up to kF8Batch = 8 steps, 512
// columns: a warp's whole slice at the 35B shape) into its own slots of
// shared memory with cp.async before any math, the block scales of
// every step into registers with them, then multiplies the steps in order,
// each as soon as its copy landed (cp.async.wait_group per step). Why:
// ncu on the session-7 kernels showed 13-26% of DRAM bandwidth, long
// scoreboard stalls the largest share and 23-34% achieved occupancy (80
// registers): with three steps in registers a warp's 8 steps took three
// dependent memory round trips, and more steps in registers cost occupancy.
// Shared memory holds 8 KB a warp without registers (three blocks of 8
// warps per SM), so at the 35B shape one load round trip per warp, issued
// before the kernel's PDL wait where the rows are known. Each lane reads
// back only the slots it copied, so no barrier is needed: wait_group makes
// a thread's own copies visible to it. Measured against the session-6 loop
// (three steps in registers) on the H200: bench/NOTES-cuda.md, "FP8 decode:
// a warp's codes staged in shared memory".
#pragma once
#include "backend/cuda/fp8_mma.cuh"

namespace flashmoe::cuda {

constexpr int kF8Batch = 8;  // steps a lane has in flight at once (512 columns)

// Waits until at most n of this thread's copy groups are pending (n a
// constant once the caller's loop is unrolled).
__device__ __forceinline__ void f8_cp_wait(int n) {
  static_assert(kF8Batch == 8, "one case per step");
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

// One lane's batch in flight: the batch's first column, its steps, and
// (lanes t = 0) the block scales of rows g and g + 8 at each step.
struct F8Batch {
  int kc, n;
  float s0[kF8Batch], s1[kF8Batch];
};

// Copies steps [kc, min(k1, kc + 512)) of rows g and g + 8 into the warp's
// slots (buf: kF8Batch x 2 x 32 uint4; step i, row g at [2i][lane], row
// g + 8 at [2i + 1][lane]), one copy group per step (kF8Batch groups always,
// the ones past the range empty), and the steps' scales into registers.
// Columns past k1 or rows past the matrix read as zero.
__device__ __forceinline__ void f8_batch_issue(const F8TileRows& R, int kc, int k1, int group, int lane, uint4* buf,
                                               F8Batch& B) {
  const int t = lane & 3;
  const uint4 z = make_uint4(0, 0, 0, 0);
  B.kc = kc;
  B.n = min(kF8Batch, (k1 - kc + kF8Step - 1) / kF8Step);
#pragma unroll
  for (int i = 0; i < kF8Batch; ++i) {
    const int base = kc + i * kF8Step, c = base + 16 * t;
    uint4* p = buf + 2 * i * 32 + lane;
    if (i < B.n) {
      if (R.w0 && c < k1) cp_async16(p, R.w0 + c);
      else *p = z;
      if (R.w1 && c < k1) cp_async16(p + 32, R.w1 + c);
      else p[32] = z;
      B.s0[i] = t == 0 && R.w0 ? __ldg(R.s0 + base / group) : 0.f;
      B.s1[i] = t == 0 && R.w1 ? __ldg(R.s1 + base / group) : 0.f;
    }
    cp_async_commit();
  }
}

// The batch's steps multiplied in order, each once its copy landed; each
// step's fp32 sums times its rows' scales added to d0 / d1 (lanes t = 0;
// in units of the split).
__device__ __forceinline__ void f8_batch_dot(const F8Batch& B, const F8Split& X, int lane, const uint4* buf,
                                             float& d0, float& d1) {
  const int g = lane >> 2, t = lane & 3;
  const uint4 z = make_uint4(0, 0, 0, 0);
  const __half* xb = g == 0 ? X.h : X.h + X.lo_off;
  const bool xl = g < 2;
#pragma unroll
  for (int i = 0; i < kF8Batch; ++i) {
    if (i < B.n) {
      f8_cp_wait(kF8Batch - 1 - i);
      const uint4 v = buf[2 * i * 32 + lane], u = buf[(2 * i + 1) * 32 + lane];
      const uint4* xp = reinterpret_cast<const uint4*>(xb + B.kc + i * kF8Step + 16 * t);
      const uint4 x0 = xl ? xp[0] : z, x1 = xl ? xp[1] : z;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      f8_step_mma(c, v, u, x0, x1);
      d0 = fmaf(c[0] + c[1], B.s0[i], d0);
      d1 = fmaf(c[2] + c[3], B.s1[i], d1);
    }
  }
}

struct F8Staged {
  using First = F8Batch;
  static constexpr int kPiece = kF8Batch * kF8Step;                  // down: one batch per slot piece
  static constexpr size_t kWarpBytes = size_t(kF8Batch) * 2 * 32 * 16;  // 8 KB
  __device__ static void first(const F8TileRows& R, int k0, int k1, int group, int lane, First& F, uint4* buf) {
    f8_batch_issue(R, k0, k1, group, lane, buf, F);
  }
  // Rows g and g + 8 over [k0, k1): the first batch from F (first() of the
  // same rows and range), the others copied then multiplied in turn.
  __device__ static void dot(const F8TileRows& R, const F8Split& X, int k0, int k1, int group, int lane, First& F,
                             uint4* buf, float& d0, float& d1) {
    d0 = d1 = 0.f;
    for (int kc = k0; kc < k1; kc += kPiece) {
      if (kc != k0) f8_batch_issue(R, kc, k1, group, lane, buf, F);
      f8_batch_dot(F, X, lane, buf, d0, d1);
    }
  }
};

// The warps' slots in a block of `warps` warps: shared memory after the
// rest (which the caller rounds to 16 bytes).
inline size_t f8_warp_bufs(int warps) { return F8Staged::kWarpBytes * size_t(warps); }
// This warp's slots in a block's shared memory at `at` (16-byte aligned).
__device__ __forceinline__ uint4* f8_warp_buf(void* at) {
  return reinterpret_cast<uint4*>(static_cast<char*>(at) + F8Staged::kWarpBytes * (threadIdx.x >> 5));
}

}  // namespace flashmoe::cuda
