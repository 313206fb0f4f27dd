// The decode step's FP8 matvec (E4M3 codes, one fp32 scale per 128 x 128
// block kept per row: S[r * nbc + b], nbc = cols / 128) against the bf16
// matvec that reads twice the bytes and a plain read of the same bytes.
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++20 -arch=sm_90 -I src -o /tmp/fp8mv bench/micro/fp8_matvec_bench.cu && /tmp/fp8mv
//
// Shapes of the 35B-A3B decode step (hidden 2048):
//   A  in-proj   12,352 x 2048, x RMS-normed inside the kernel (nw, eps 1e-6)
//   B  out-proj   2,048 x 4096, no norm (nw = nullptr)
// Each shape has 40 distinct matrices (one per layer: far more than the L2),
// and every kernel is timed as 40 launches back to back, one per matrix, in
// ONE CUDA graph with programmatic dependent launch on every launch but the
// first (through Launcher::go, as the decode step), the graph replayed 50
// times after warm-up:
// median microseconds per launch and effective TB/s (weight bytes, scales
// included, over that time).
//
// Kernels, and why each is here:
//   read          a plain streaming read of the same FP8 bytes (16-byte
//                 loads, one resident wave of blocks, an xor of the words
//                 written out): the bandwidth ceiling for a launch of this
//                 size, PDL overlap included.
//   bf16          the production matvec_kernel<__nv_bfloat16> on bf16
//                 matrices of the same shape, launched with exactly the
//                 parameters CudaModel::Impl::matvec computes (split_for,
//                 per_sm, pf_rows, 2 or 3 rows per warp, shared memory).
//   f8mma         the production matvec_fp8_mma_kernel with exactly
//                 matvec_fp8's parameters (f8_mma_split, f8_mma_matvec_smem,
//                 per_sm, pf): what the decode step runs for 128-wide blocks.
//   f8ffma        the production FFMA matvec_fp8_kernel (group 128 passed;
//                 production sends only other block widths there) with its
//                 launch parameters.
//   f8rows        the production matvec_fp8_rows_kernel (fp8_rows.cuh)
//                 with matvec_fp8's parameters: whole rows per warp, what
//                 the decode step runs since it won here (its variants, R
//                 2 / 4 rows, 8- / 16-byte loads, next rows in flight:
//                 bench/NOTES-cuda.md, "FP8 decode: whole rows per warp").
// Every kernel's y for matrix 0 is checked against a host double-precision
// reference: max over rows of |y - ref| / sum_c |w_rc| |x_c|.
//
// Build (from the repository root):
//   nvcc -O3 -std=c++20 -arch=sm_90 -I src -o /tmp/fp8mv bench/micro/fp8_matvec_bench.cu
// (add -Xptxas -v for the registers and spills of every kernel)
// Run: /tmp/fp8mv   (one Hopper GPU; ~4 GB of device memory; a few seconds)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "backend/cuda/fp8_matvec.cuh"
#include "backend/cuda/fp8_rows.cuh"
#include "backend/cuda/launch.cuh"
#include "fp8_micro_data.cuh"

using namespace flashmoe::cuda;
using namespace flashmoe::micro;

namespace {

constexpr int kLayers = 40;    // distinct matrices per shape (one per layer)
constexpr int kReplays = 50;   // timed graph replays
constexpr int kWarmup = 5;
constexpr int kGroup = 128;    // FP8 block width
constexpr float kEps = 1e-6f;

// ------------------------------------------------------------ data on the device

// The bf16 twin of a FP8 matrix: bf16(code x scale).
__global__ void gen_bf16(__nv_bfloat16* wb, const uint8_t* w, const float* s, int rows, int cols) {
  const int nbc = cols / kGroup;
  const size_t n = size_t(rows) * cols;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / cols, c = i % cols;
    const __half_raw h = __nv_cvt_fp8_to_halfraw(w[i], __NV_E4M3);
    wb[i] = __float2bfloat16(__half2float(__half(h)) * s[r * nbc + c / kGroup]);
  }
}

// ------------------------------------------------------------ 1. the read ceiling

// Streams `bytes` bytes (a multiple of 16) with 16-byte non-allocating loads,
// four in flight per thread per iteration; the xor of the words goes to
// out[blockIdx.x] after the PDL wait (the only write, so the launch after
// may start its loads as soon as this one's blocks finish theirs).
__global__ void __launch_bounds__(kThreads) read_kernel(const uint8_t* __restrict__ p, size_t bytes,
                                                        uint32_t* __restrict__ out) {
  pdl_trigger();
  const size_t n = bytes / 16, stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = ld_stream(p + 16 * i), b = ld_stream(p + 16 * (i + stride)),
                c = ld_stream(p + 16 * (i + 2 * stride)), d = ld_stream(p + 16 * (i + 3 * stride));
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = ld_stream(p + 16 * i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  xor_out(acc, out);
}

// ------------------------------------------------------------ host side

struct Shape {
  const char* name;
  int rows, cols;
  bool norm;
  // per matrix: codes then scales at scale_offset (as DMat), `stride` bytes apart
  size_t scale_offset() const { return (size_t(rows) * cols + 15) / 16 * 16; }
  int nbc() const { return cols / kGroup; }
  size_t fp8_bytes() const { return scale_offset() + size_t(rows) * nbc() * 4; }  // DMat::bytes()
  size_t stride() const { return (fp8_bytes() + 255) / 256 * 256; }
  size_t weight_bytes() const { return size_t(rows) * cols + size_t(rows) * nbc() * 4; }  // codes + scales
};

struct Bench {
  Launcher L;
  int sms = 0;
  cudaEvent_t e0, e1;
};

// Times `launch(k)` for k = 0..kLayers-1 captured in one graph; median us per launch.
double time_graph(Bench& B, const std::function<void(int)>& launch) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CKB(cudaStreamBeginCapture(B.L.stream, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < kLayers; ++k) {
    B.L.pdl_next = k > 0;  // PDL on every launch but the graph's first (as a decode step's first launch)
    launch(k);
  }
  CKB(cudaStreamEndCapture(B.L.stream, &graph));
  CKB(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < kWarmup; ++i) CKB(cudaGraphLaunch(exec, B.L.stream));
  CKB(cudaStreamSynchronize(B.L.stream));
  std::vector<float> ms(kReplays);
  for (int i = 0; i < kReplays; ++i) {
    CKB(cudaEventRecord(B.e0, B.L.stream));
    CKB(cudaGraphLaunch(exec, B.L.stream));
    CKB(cudaEventRecord(B.e1, B.L.stream));
    CKB(cudaEventSynchronize(B.e1));
    CKB(cudaEventElapsedTime(&ms[i], B.e0, B.e1));
  }
  CKB(cudaGraphExecDestroy(exec));
  CKB(cudaGraphDestroy(graph));
  std::sort(ms.begin(), ms.end());
  return double(ms[kReplays / 2]) * 1000.0 / kLayers;
}

// Max over rows of |y - ref| / sum |w||x|.
double max_rel(const std::vector<float>& y, const std::vector<double>& ref, const std::vector<double>& den) {
  double m = 0;
  for (size_t r = 0; r < ref.size(); ++r) {
    const double e = std::isfinite(y[r]) ? std::fabs(double(y[r]) - ref[r]) / std::max(den[r], 1e-300) : INFINITY;
    m = std::max(m, e);
  }
  return m;
}

// err < 0: nothing to check (the read).
void report(const char* kernel, const Shape& sh, const char* params, double us, size_t bytes, double err) {
  char e[32];
  if (err < 0) std::snprintf(e, sizeof e, "%-8s", "-");
  else std::snprintf(e, sizeof e, "%.2e", err);
  std::printf("%-22s %-8s %8.2f us  %6.3f TB/s  err %s  %s\n", kernel, sh.name, us, double(bytes) / (us * 1e-6) / 1e12,
              e, params);
}

void run_shape(Bench& B, const Shape& sh, uint64_t seed) {
  const int rows = sh.rows, cols = sh.cols, nbc = sh.nbc();
  const size_t stride = sh.stride();
  // ---- data: 40 FP8 matrices (codes + per-row scales, DMat layout), their bf16 twins, x, nw
  uint8_t* W8;
  __nv_bfloat16* Wb;
  float *x, *nwd = nullptr, *Y;
  uint32_t* sink;
  CKB(cudaMalloc(&W8, stride * kLayers));
  CKB(cudaMalloc(&Wb, size_t(rows) * cols * 2 * kLayers));
  CKB(cudaMalloc(&x, cols * 4));
  CKB(cudaMalloc(&Y, size_t(kLayers) * rows * 4));
  CKB(cudaMalloc(&sink, 4096 * 4));
  for (int k = 0; k < kLayers; ++k) {
    uint8_t* w = W8 + k * stride;
    float* s = reinterpret_cast<float*>(w + sh.scale_offset());
    gen_codes<<<1024, 256>>>(w, size_t(rows) * cols, seed + 2 * k);
    gen_scales<<<64, 256>>>(s, size_t(rows) * nbc, seed + 2 * k + 1, 1.0f / 256.0f);
    gen_bf16<<<2048, 256>>>(Wb + size_t(k) * rows * cols, w, s, rows, cols);
  }
  CKB(cudaGetLastError());
  std::vector<float> hx(cols), hnw(cols);
  for (int c = 0; c < cols; ++c) {
    hx[c] = 2.f * unit(mix64(seed * 31 + c)) - 1.f;
    hnw[c] = 0.4f * unit(mix64(seed * 37 + c)) - 0.2f;
  }
  CKB(cudaMemcpy(x, hx.data(), cols * 4, cudaMemcpyHostToDevice));
  if (sh.norm) {
    CKB(cudaMalloc(&nwd, cols * 4));
    CKB(cudaMemcpy(nwd, hnw.data(), cols * 4, cudaMemcpyHostToDevice));
  }
  CKB(cudaDeviceSynchronize());

  // ---- host references for matrix 0 (double)
  std::vector<uint8_t> hw(size_t(rows) * cols);
  std::vector<float> hs(size_t(rows) * nbc);
  std::vector<__nv_bfloat16> hb(size_t(rows) * cols);
  CKB(cudaMemcpy(hw.data(), W8, hw.size(), cudaMemcpyDeviceToHost));
  CKB(cudaMemcpy(hs.data(), W8 + sh.scale_offset(), hs.size() * 4, cudaMemcpyDeviceToHost));
  CKB(cudaMemcpy(hb.data(), Wb, hb.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> xn(cols);
  {
    double ss = 0;
    for (int c = 0; c < cols; ++c) ss += double(hx[c]) * hx[c];
    const double r = sh.norm ? 1.0 / std::sqrt(ss / cols + double(kEps)) : 1.0;
    for (int c = 0; c < cols; ++c) xn[c] = double(hx[c]) * r * (sh.norm ? 1.0 + double(hnw[c]) : 1.0);
  }
  double lut[256];
  for (int b = 0; b < 256; ++b) lut[b] = e4m3_value(uint8_t(b));
  std::vector<double> ref8(rows), den8(rows), refb(rows), denb(rows);
  for (int r = 0; r < rows; ++r) {
    double a = 0, d = 0, ab = 0, db = 0;
    for (int c = 0; c < cols; ++c) {
      const double w = lut[hw[size_t(r) * cols + c]] * double(hs[size_t(r) * nbc + c / kGroup]);
      const double wb = double(__bfloat162float(hb[size_t(r) * cols + c]));
      a += w * xn[c];
      d += std::fabs(w * xn[c]);
      ab += wb * xn[c];
      db += std::fabs(wb * xn[c]);
    }
    ref8[r] = a, den8[r] = d, refb[r] = ab, denb[r] = db;
  }
  auto y0 = [&]() {
    CKB(cudaDeviceSynchronize());
    std::vector<float> y(rows);
    CKB(cudaMemcpy(y.data(), Y, rows * 4, cudaMemcpyDeviceToHost));
    return y;
  };
  const float* nw = sh.norm ? nwd : nullptr;
  const cudaDeviceProp& prop = B.L.prop;
  char p[200];

  // ---- 1. read: the same FP8 bytes (codes + scales), one resident wave
  {
    int occ = 0;
    CKB(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, read_kernel, kThreads, 0));
    const int blocks = std::min(B.sms * occ, 4096);
    const double us = time_graph(B, [&](int k) {
      B.L.go(read_kernel, blocks, kThreads, 0, static_cast<const uint8_t*>(W8 + k * stride), sh.fp8_bytes(), sink);
    });
    std::snprintf(p, sizeof p, "blocks %d (%d/SM), %zu bytes", blocks, occ, sh.fp8_bytes());
    report("read", sh, p, us, sh.weight_bytes(), -1.0);
  }

  // ---- 2. production bf16 matvec_kernel, CudaModel::Impl::matvec's parameters
  {
    auto fn = matvec_kernel<__nv_bfloat16>;
    const int split = B.L.split_for(rows, cols, 8);
    const int rpb = kWarps / split;
    const size_t smem = nw ? size_t(cols) * 4 : 0;
    const int blocks = std::min((rows + rpb - 1) / rpb, prop.multiProcessorCount * B.L.per_sm((const void*)fn, smem));
    const size_t bytes = size_t(rows) * cols * 2;  // DMat::bytes()
    const int pf = B.L.pf_rows(bytes, rows, blocks, rpb);
    const int per_warp = (rows + blocks * rpb - 1) / (blocks * rpb);
    const int per = per_warp == 3 ? 3 : 2;  // opts.decode.force_three_rows off
    CKB(cudaMemset(Y, 0xff, size_t(kLayers) * rows * 4));
    const double us = time_graph(B, [&](int k) {
      B.L.go(fn, blocks, kThreads, smem, static_cast<const __nv_bfloat16*>(Wb + size_t(k) * rows * cols), rows, cols,
             static_cast<const float*>(x), nw, kEps, Y + size_t(k) * rows, 0, split, pf, per, (float*)nullptr);
    });
    std::snprintf(p, sizeof p, "blocks %d split %d pf %d per %d smem %zu", blocks, split, pf, per, smem);
    report("bf16 matvec_kernel", sh, p, us, bytes, max_rel(y0(), refb, denb));
  }

  // ---- 3. production matvec_fp8_mma_kernel, matvec_fp8's parameters
  {
    const int split = f8_mma_split(rows, cols, prop.multiProcessorCount), tpb = kWarps / split;
    const size_t smem = f8_mma_matvec_smem(cols, f8_norm_fused(nw, cols));
    const int tiles = (rows + 15) / 16;
    const int blocks = std::min((tiles + tpb - 1) / tpb,
                                prop.multiProcessorCount * B.L.per_sm((const void*)matvec_fp8_mma_kernel, smem));
    const bool pf = f8_padded((cols + split - 1) / split) > F8Staged::kPiece;
    CKB(cudaMemset(Y, 0xff, size_t(kLayers) * rows * 4));
    const double us = time_graph(B, [&](int k) {
      const uint8_t* w = W8 + k * stride;
      B.L.go(matvec_fp8_mma_kernel, blocks, kThreads, smem, w, reinterpret_cast<const float*>(w + sh.scale_offset()),
             kGroup, rows, cols, static_cast<const float*>(x), nw, kEps, Y + size_t(k) * rows, 0, split, pf ? 1 : 0,
             (float*)nullptr);
    });
    std::snprintf(p, sizeof p, "blocks %d (%d/SM) split %d pf %d smem %zu", blocks,
                  B.L.per_sm((const void*)matvec_fp8_mma_kernel, smem), split, int(pf), smem);
    report("f8mma (production)", sh, p, us, sh.weight_bytes(), max_rel(y0(), ref8, den8));
  }

  // ---- 4. production FFMA matvec_fp8_kernel (group 128), its launch parameters
  {
    const int split = B.L.split_for(rows, cols, 16);
    const int rpb = kWarps / split;
    const size_t smem = nw ? size_t(cols) * 4 : 0;
    const int blocks = std::min((rows + rpb - 1) / rpb,
                                prop.multiProcessorCount * B.L.per_sm((const void*)matvec_fp8_kernel, smem));
    const int pf = B.L.pf_rows(size_t(rows) * cols, rows, blocks, rpb);
    const int per_warp = (rows + blocks * rpb - 1) / (blocks * rpb);
    const int per = std::clamp(per_warp, 1, 4);
    CKB(cudaMemset(Y, 0xff, size_t(kLayers) * rows * 4));
    const double us = time_graph(B, [&](int k) {
      const uint8_t* w = W8 + k * stride;
      B.L.go(matvec_fp8_kernel, blocks, kThreads, smem, w, reinterpret_cast<const float*>(w + sh.scale_offset()),
             kGroup, rows, cols, static_cast<const float*>(x), nw, kEps, Y + size_t(k) * rows, 0, split, pf, per,
             (float*)nullptr);
    });
    std::snprintf(p, sizeof p, "blocks %d split %d pf %d per %d smem %zu", blocks, split, pf, per, smem);
    report("f8ffma (production)", sh, p, us, sh.weight_bytes(), max_rel(y0(), ref8, den8));
  }

  // ---- 5. production matvec_fp8_rows_kernel (fp8_rows.cuh), matvec_fp8's parameters
  if (const int split = f8_rows_split(cols, kGroup)) {
    const void* fn = reinterpret_cast<const void*>(matvec_fp8_rows_kernel);
    const size_t smem = f8_rows_smem(cols);
    const int rpb = kWarps / split, groups = (rows + kF8RowsR - 1) / kF8RowsR;
    const int blocks = std::min((groups + rpb - 1) / rpb, prop.multiProcessorCount * B.L.per_sm(fn, smem));
    CKB(cudaMemset(Y, 0xff, size_t(kLayers) * rows * 4));
    const double us = time_graph(B, [&](int k) {
      const uint8_t* w = W8 + k * stride;
      B.L.go(matvec_fp8_rows_kernel, blocks, kThreads, smem, w, reinterpret_cast<const float*>(w + sh.scale_offset()),
             kGroup, rows, cols, static_cast<const float*>(x), nw, kEps, Y + size_t(k) * rows, 0, split,
             (float*)nullptr);
    });
    std::snprintf(p, sizeof p, "blocks %d (%d/SM) split %d R %d", blocks, B.L.per_sm(fn, smem), split, kF8RowsR);
    report("f8rows (production)", sh, p, us, sh.weight_bytes(), max_rel(y0(), ref8, den8));
  }

  CKB(cudaFree(W8));
  CKB(cudaFree(Wb));
  CKB(cudaFree(x));
  CKB(cudaFree(Y));
  CKB(cudaFree(sink));
  if (nwd) CKB(cudaFree(nwd));
}

}  // namespace

int main() {
  Bench B;
  CKB(cudaSetDevice(0));
  CKB(cudaGetDeviceProperties(&B.L.prop, 0));
  B.sms = B.L.prop.multiProcessorCount;
  std::printf("device: %s, %d SMs, L2 %.1f MB, smem opt-in %zu B, cc %d.%d\n", B.L.prop.name, B.sms,
              B.L.prop.l2CacheSize / 1e6, size_t(B.L.prop.sharedMemPerBlockOptin), B.L.prop.major, B.L.prop.minor);
  if (B.L.prop.major < 9) {
    std::printf("needs sm_90 (Hopper)\n");
    return 1;
  }
  CKB(cudaStreamCreateWithFlags(&B.L.stream, cudaStreamNonBlocking));
  CKB(cudaEventCreate(&B.e0));
  CKB(cudaEventCreate(&B.e1));
  // As CudaModel::Impl::set_kernel_attributes.
  const int big = int(B.L.prop.sharedMemPerBlockOptin) - 4096;
  CKB(cudaFuncSetAttribute(matvec_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CKB(cudaFuncSetAttribute(matvec_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CKB(cudaFuncSetAttribute(matvec_fp8_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CKB(cudaFuncSetAttribute(matvec_fp8_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  std::printf("%d matrices per shape, one launch each in one graph (PDL), median of %d replays\n", kLayers, kReplays);
  std::printf("%-22s %-8s %11s  %11s  %-12s %s\n", "kernel", "shape", "per launch", "effective", "max rel err",
              "launch");
  const Shape A{"A-inproj", 12352, 2048, true}, Bo{"B-outprj", 2048, 4096, false};
  run_shape(B, A, 1000);
  run_shape(B, Bo, 2000);
  return 0;
}
