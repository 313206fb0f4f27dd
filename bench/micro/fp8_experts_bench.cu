// The decode step's FP8 routed experts (gate_up then down, k = 8 of E plus
// the FP8 shared expert, 128 x 128 scale blocks) at the 35B-A3B shape:
// the tensor-core kernels (fp8_experts.cuh), gate_up by whole rows through
// shared memory (fp8_gate_up_smem.cuh; R h rows a warp, production
// kF8XGuRows) before the same tensor-core down, whose first codes are
// loaded before its PDL wait where the pick was final before gate_up
// (MoeArgs::sel_ready: "down early") or after it, and a plain read of the
// same bytes. Build and run on the GPU machine (from the repository root):
//   nvcc -O3 -std=c++20 -arch=sm_90 -I src -o /tmp/fp8ex bench/micro/fp8_experts_bench.cu && /tmp/fp8ex
// (add -Xptxas -v for the registers and spills of every kernel)
//
// 40 layers of E = 16 experts each (one layer's 16 are 50 MB, the 40 far
// more than the L2), 8 picked at random per layer; every variant is timed
// as its 80 launches (gate_up and down of each layer) back to back in ONE
// CUDA graph with programmatic dependent launch, as the decode step runs
// them, the graph replayed 50 times after warm-up: median microseconds per
// layer (both kernels; "alone": 40 launches of one kernel) and effective
// TB/s (the picked experts' and the shared expert's codes and scales over
// that time). The variants that lost (session 13: down by rows, gate_up
// with a copy group per step; session 14: gate_up prefetching down's
// matrices into L2) are in bench/NOTES-cuda.md.
//
// Correctness: layer 0 from the same x by each variant, against a host
// double-precision reference of x + sum_j w_j down_j (silu(gate_j xn) *
// up_j xn): max over rows of |x' - ref| / (|x| + sum over terms of |w_j|
// |down_j,r| |h_j|).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "backend/cuda/device_model.cuh"
#include "backend/cuda/fp8_experts.cuh"
#include "backend/cuda/fp8_gate_up_smem.cuh"
#include "backend/cuda/launch.cuh"
#include "fp8_micro_data.cuh"

using namespace flashmoe::cuda;
using namespace flashmoe::micro;

namespace {

constexpr int kLayers = 40, kReplays = 50, kWarmup = 5;
constexpr int H = 2048, I = 512, Is = 512, E = 16, K = 8, G = 128;
constexpr float kEps = 1e-6f;
constexpr float kScale = 1.0f / 128.0f;  // block scales 2^-7 x [0.5, 1.5): h and the x update stay O(1)

// A plain streaming read of each slot's bytes (blockIdx.y = slot): the xor
// of the words goes to out after the PDL wait.
__global__ void __launch_bounds__(kThreads) read_slots_kernel(const void* const* p, size_t bytes, uint32_t* out) {
  pdl_trigger();
  const uint8_t* b = static_cast<const uint8_t*>(p[blockIdx.y]);
  const size_t n = bytes / 16, stride = size_t(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const uint4 a = ld_stream(b + 16 * i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  xor_out(acc, out);
}

struct Layer {
  uint8_t *gu, *dn;                 // E expert blocks each (q.gu_bytes / q.dn_bytes apart)
  uint8_t *sgu, *sdn;               // shared expert codes [2 Is][H], [H][Is]
  float *sgu_sc, *sdn_sc;           // their per-row block scales
  const void** sel;                 // device [2K + 1] (gu of the K slots, dn of the K slots)
  const void** rd;                  // device [2K + 2]: the read's slots (gu K + shared gu, dn K + shared dn)
  float* w;                         // [K + 1]
  std::vector<int> pick;
};

double time_graph(Launcher& L, cudaEvent_t e0, cudaEvent_t e1, const std::function<void(int)>& layer) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CKB(cudaStreamBeginCapture(L.stream, cudaStreamCaptureModeGlobal));
  L.pdl_next = false;
  for (int l = 0; l < kLayers; ++l) layer(l);
  CKB(cudaStreamEndCapture(L.stream, &graph));
  CKB(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < kWarmup; ++i) CKB(cudaGraphLaunch(exec, L.stream));
  CKB(cudaStreamSynchronize(L.stream));
  std::vector<float> ms(kReplays);
  for (int i = 0; i < kReplays; ++i) {
    CKB(cudaEventRecord(e0, L.stream));
    CKB(cudaGraphLaunch(exec, L.stream));
    CKB(cudaEventRecord(e1, L.stream));
    CKB(cudaEventSynchronize(e1));
    CKB(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  CKB(cudaGraphExecDestroy(exec));
  CKB(cudaGraphDestroy(graph));
  std::sort(ms.begin(), ms.end());
  return double(ms[kReplays / 2]) * 1000.0 / kLayers;
}

}  // namespace

int main() {
  Launcher L;
  CKB(cudaSetDevice(0));
  CKB(cudaGetDeviceProperties(&L.prop, 0));
  const int sms = L.prop.multiProcessorCount;
  std::printf("device: %s, %d SMs, L2 %.1f MB\n", L.prop.name, sms, L.prop.l2CacheSize / 1e6);
  if (L.prop.major < 9) return std::printf("needs sm_90 (Hopper)\n"), 1;
  CKB(cudaStreamCreateWithFlags(&L.stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CKB(cudaEventCreate(&e0));
  CKB(cudaEventCreate(&e1));
  const QExpert q = make_fp8expert(G, G, H, I);
  const int nbcH = H / G, nbcI = I / G;
  std::vector<Layer> Ls(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    Layer& y = Ls[l];
    const uint64_t seed = 1000 + 17 * l;
    CKB(cudaMalloc(&y.gu, q.gu_bytes * E));
    CKB(cudaMalloc(&y.dn, q.dn_bytes * E));
    CKB(cudaMalloc(&y.sgu, std::max(size_t(2 * Is) * H, q.gu_bytes)));  // the read takes q's sizes for every slot
    CKB(cudaMalloc(&y.sdn, std::max(size_t(H) * Is, q.dn_bytes)));
    CKB(cudaMalloc(&y.sgu_sc, size_t(2 * Is) * nbcH * 4));
    CKB(cudaMalloc(&y.sdn_sc, size_t(H) * (Is / G) * 4));
    for (int e = 0; e < E; ++e) {
      uint8_t* b = y.gu + q.gu_bytes * e;
      gen_codes<<<512, 256>>>(b, size_t(I) * H, seed + 100 * e);
      gen_codes<<<512, 256>>>(b + q.up_w, size_t(I) * H, seed + 100 * e + 1);
      gen_scales<<<8, 256>>>(reinterpret_cast<float*>(b + q.gate_s), size_t(I / G) * nbcH, seed + 100 * e + 2, kScale);
      gen_scales<<<8, 256>>>(reinterpret_cast<float*>(b + q.up_s), size_t(I / G) * nbcH, seed + 100 * e + 3, kScale);
      uint8_t* d = y.dn + q.dn_bytes * e;
      gen_codes<<<512, 256>>>(d, size_t(H) * I, seed + 100 * e + 4);
      gen_scales<<<8, 256>>>(reinterpret_cast<float*>(d + q.dn_s), size_t(H / G) * nbcI, seed + 100 * e + 5, kScale);
    }
    gen_codes<<<512, 256>>>(y.sgu, size_t(2 * Is) * H, seed + 7);
    gen_codes<<<512, 256>>>(y.sdn, size_t(H) * Is, seed + 8);
    gen_scales<<<64, 256>>>(y.sgu_sc, size_t(2 * Is) * nbcH, seed + 9, kScale);
    gen_scales<<<64, 256>>>(y.sdn_sc, size_t(H) * (Is / G), seed + 10, kScale);
    std::vector<int> all(E);
    for (int e = 0; e < E; ++e) all[e] = e;
    for (int e = E - 1; e > 0; --e) std::swap(all[e], all[mix64(seed + e) % (e + 1)]);
    y.pick.assign(all.begin(), all.begin() + K);
    std::vector<const void*> sel(2 * K + 1), rd(2 * K + 2);
    for (int j = 0; j < K; ++j) {
      sel[j] = rd[j] = y.gu + q.gu_bytes * y.pick[j];
      sel[K + j] = rd[K + 1 + j] = y.dn + q.dn_bytes * y.pick[j];
    }
    rd[K] = y.sgu;
    rd[2 * K + 1] = y.sdn;
    CKB(cudaMalloc(&y.sel, sel.size() * sizeof(void*)));
    CKB(cudaMalloc(&y.rd, rd.size() * sizeof(void*)));
    CKB(cudaMemcpy(y.sel, sel.data(), sel.size() * sizeof(void*), cudaMemcpyHostToDevice));
    CKB(cudaMemcpy(y.rd, rd.data(), rd.size() * sizeof(void*), cudaMemcpyHostToDevice));
    std::vector<float> w(K + 1);
    for (int j = 0; j <= K; ++j) w[j] = 0.05f + 0.2f * unit(mix64(seed * 3 + j));
    CKB(cudaMalloc(&y.w, (K + 1) * 4));
    CKB(cudaMemcpy(y.w, w.data(), (K + 1) * 4, cudaMemcpyHostToDevice));
  }
  float *x, *x0, *nw, *hb;
  uint32_t* sink;
  CKB(cudaMalloc(&x, H * 4));
  CKB(cudaMalloc(&x0, H * 4));
  CKB(cudaMalloc(&nw, H * 4));
  CKB(cudaMalloc(&hb, (K + 1) * std::max(I, Is) * 4));
  CKB(cudaMalloc(&sink, 4096 * 4));
  std::vector<float> hx(H), hnw(H);
  for (int c = 0; c < H; ++c) {
    hx[c] = 2.f * unit(mix64(77 * 31 + c)) - 1.f;
    hnw[c] = 0.4f * unit(mix64(77 * 37 + c)) - 0.2f;
  }
  CKB(cudaMemcpy(x0, hx.data(), H * 4, cudaMemcpyHostToDevice));
  CKB(cudaMemcpy(nw, hnw.data(), H * 4, cudaMemcpyHostToDevice));
  CKB(cudaDeviceSynchronize());

  int sel_ready = 0;  // down reads its rows before its wait (MoeArgs::sel_ready)
  auto args = [&](int l) {
    const Layer& y = Ls[l];
    MoeArgs a{};
    a.sel_ready = sel_ready;
    a.s_gu = y.sgu;
    a.s_down = y.sdn;
    a.s_gu_sc = y.sgu_sc;
    a.s_down_sc = y.sdn_sc;
    a.s_group = G;
    a.sel = y.sel;
    a.w = y.w;
    a.k = K, a.I = I, a.Is = Is, a.H = H, a.maxI = std::max(I, Is), a.has_shared = 1;
    a.norm_w = nw;
    a.eps = kEps;
    a.x = x;
    a.hb = hb;
    return a;
  };
  const int slots = K + 1;
  const size_t optin = size_t(L.prop.sharedMemPerBlockOptin) - 4096;

  // ---- the production tensor-core kernels, moe_launch_q's parameters
  auto gu_mma = gate_up_fp8_mma_kernel<F8Rows>;
  auto dn_mma = down_fp8_mma_kernel<F8Rows>;
  const MoeArgs a0 = args(0);
  const size_t m1 = f8_mma_gate_up_smem(H, f8_gate_up_xf(a0, true));
  const int dw = f8_down_warps(a0, true);
  const size_t m2 = f8_mma_down_smem(K, I, Is, true, dw);
  CKB(cudaFuncSetAttribute(gu_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(m1)));
  CKB(cudaFuncSetAttribute(dn_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(m2)));
  const int tpb = kWarps / kGuSplit, need = ((a0.maxI + 7) / 8 + tpb - 1) / tpb;
  const dim3 g_mma(std::max(1, std::min(need, L.per_sm((const void*)gu_mma, m1) * sms / slots)), slots);
  const int d_mma = std::min((H + 15) / 16, L.per_sm((const void*)dn_mma, m2, dw * 32) * sms);
  auto run_mma = [&](int l) {
    const MoeArgs a = args(l);
    L.go(gu_mma, g_mma, kThreads, m1, a, q);
    L.go(dn_mma, d_mma, dw * 32, m2, a, q);
  };
  (void)optin;
  // ---- gate_up by whole rows through shared memory (R h rows a warp; production R = kF8XGuRows), the same down
  const bool takes = f8x_gate_up_takes(a0, q, true, optin);
  struct XPlan {
    size_t smem;
    dim3 grid;
    int per_sm;
  };
  auto plan_gu = [&](auto kern, int R) {
    const size_t x1 = f8x_gate_up_smem(H, G, G, R);
    CKB(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(x1)));
    const int ps = L.per_sm((const void*)kern, x1), gneed = (std::max(I, Is) + kWarps * R - 1) / (kWarps * R);
    return XPlan{x1, dim3(std::max(1, std::min(gneed, ps * sms / slots)), slots), ps};
  };
  const XPlan g1 = plan_gu(gate_up_fp8_smem_kernel<1>, 1), g2 = plan_gu(gate_up_fp8_smem_kernel<2>, 2),
              g4 = plan_gu(gate_up_fp8_smem_kernel<4>, 4);
  auto gu_smem = [&](auto kern, const XPlan& P) {
    return [&, kern, P](int l) { L.go(kern, P.grid, kThreads, P.smem, args(l), q); };
  };
  auto dn_mma_f = [&](int l) { L.go(dn_mma, d_mma, dw * 32, m2, args(l), q); };
  auto gu_mma_f = [&](int l) { L.go(gu_mma, g_mma, kThreads, m1, args(l), q); };
  auto both = [](auto f, auto g) {
    return [f, g](int l) {
      f(l);
      g(l);
    };
  };
  // ---- the read
  auto run_read = [&](int l) {
    const Layer& y = Ls[l];
    L.go(read_slots_kernel, dim3(std::max(1, 2 * sms / slots), slots), kThreads, 0,
         static_cast<const void* const*>(y.rd), q.gu_bytes, sink);
    L.go(read_slots_kernel, dim3(std::max(1, 2 * sms / slots), slots), kThreads, 0,
         static_cast<const void* const*>(y.rd + slots), q.dn_bytes, sink);
  };

  // ---- host reference for layer 0
  const Layer& y0 = Ls[0];
  std::vector<double> ref(H), den(H);
  {
    double lut[256];
    for (int b = 0; b < 256; ++b) lut[b] = e4m3_value(uint8_t(b));
    double ss = 0;
    for (int c = 0; c < H; ++c) ss += double(hx[c]) * hx[c];
    const double rn = 1.0 / std::sqrt(ss / H + kEps);
    std::vector<double> xn(H);
    for (int c = 0; c < H; ++c) xn[c] = hx[c] * rn * (1.0 + hnw[c]);
    std::vector<float> w(K + 1);
    CKB(cudaMemcpy(w.data(), y0.w, (K + 1) * 4, cudaMemcpyDeviceToHost));
    for (int r = 0; r < H; ++r) ref[r] = hx[r], den[r] = std::fabs(hx[r]);
    for (int j = 0; j <= K; ++j) {
      const bool sh = j == K;
      const int n = sh ? Is : I;
      std::vector<uint8_t> gu(size_t(2 * n) * H), dn(size_t(H) * n);
      std::vector<float> gs, us, ds;
      if (sh) {
        CKB(cudaMemcpy(gu.data(), y0.sgu, gu.size(), cudaMemcpyDeviceToHost));
        CKB(cudaMemcpy(dn.data(), y0.sdn, dn.size(), cudaMemcpyDeviceToHost));
        gs.resize(size_t(2 * n) * nbcH);
        ds.resize(size_t(H) * (n / G));
        CKB(cudaMemcpy(gs.data(), y0.sgu_sc, gs.size() * 4, cudaMemcpyDeviceToHost));
        CKB(cudaMemcpy(ds.data(), y0.sdn_sc, ds.size() * 4, cudaMemcpyDeviceToHost));
      } else {
        const uint8_t* b = y0.gu + q.gu_bytes * y0.pick[j];
        const uint8_t* d = y0.dn + q.dn_bytes * y0.pick[j];
        CKB(cudaMemcpy(gu.data(), b, size_t(n) * H, cudaMemcpyDeviceToHost));
        CKB(cudaMemcpy(gu.data() + size_t(n) * H, b + q.up_w, size_t(n) * H, cudaMemcpyDeviceToHost));
        CKB(cudaMemcpy(dn.data(), d, dn.size(), cudaMemcpyDeviceToHost));
        gs.resize(size_t(n / G) * nbcH);
        us.resize(gs.size());
        ds.resize(size_t(H / G) * nbcI);
        CKB(cudaMemcpy(gs.data(), b + q.gate_s, gs.size() * 4, cudaMemcpyDeviceToHost));
        CKB(cudaMemcpy(us.data(), b + q.up_s, us.size() * 4, cudaMemcpyDeviceToHost));
        CKB(cudaMemcpy(ds.data(), d + q.dn_s, ds.size() * 4, cudaMemcpyDeviceToHost));
      }
      // scale of (row, column) of gate (part 0) / up (part 1) / down (part 2)
      auto sc = [&](int part, int r, int c) -> double {
        if (sh) return part < 2 ? gs[size_t(r + part * n) * nbcH + c / G] : ds[size_t(r) * (n / G) + c / G];
        if (part == 0) return gs[size_t(r / G) * nbcH + c / G];
        if (part == 1) return us[size_t(r / G) * nbcH + c / G];
        return ds[size_t(r / G) * nbcI + c / G];
      };
      std::vector<double> h(n);
      for (int r = 0; r < n; ++r) {
        double g = 0, u = 0;
        for (int c = 0; c < H; ++c) {
          g += lut[gu[size_t(r) * H + c]] * sc(0, r, c) * xn[c];
          u += lut[gu[size_t(n + r) * H + c]] * sc(1, r, c) * xn[c];
        }
        h[r] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int r = 0; r < H; ++r) {
        double s = 0, d = 0;
        for (int c = 0; c < n; ++c) {
          const double t = lut[dn[size_t(r) * n + c]] * sc(2, r, c) * h[c];
          s += t;
          d += std::fabs(t);
        }
        ref[r] += double(w[j]) * s;
        den[r] += std::fabs(double(w[j])) * d;
      }
    }
  }
  auto check = [&](const std::function<void(int)>& run) {
    // On the kernels' stream: a plain cudaMemcpy goes to the legacy stream,
    // which the non-blocking L.stream does not wait for (the kernels could
    // read x half reset).
    CKB(cudaMemcpyAsync(x, x0, H * 4, cudaMemcpyDeviceToDevice, L.stream));
    L.pdl_next = false;
    run(0);
    CKB(cudaDeviceSynchronize());
    std::vector<float> got(H);
    CKB(cudaMemcpy(got.data(), x, H * 4, cudaMemcpyDeviceToHost));
    double m = 0;
    for (int r = 0; r < H; ++r)
      m = std::max(m, std::isfinite(got[r]) ? std::fabs(got[r] - ref[r]) / std::max(den[r], 1e-30) : INFINITY);
    return m;
  };

  const double bytes = double(K) * (q.gu_bytes + q.dn_bytes) + double(2 * Is) * H * 1.0 + double(H) * Is +
                       (double(2 * Is) * nbcH + double(H) * (Is / G)) * 4;
  std::printf("35B shape: H %d, I %d, shared %d, k %d of %d per layer, %d layers; %.2f MB per layer\n", H, I, Is, K, E,
              kLayers, bytes / 1e6);
  std::printf("%-34s %10s %11s  %-10s %s\n", "kernels (gate_up + down)", "per layer", "effective", "max rel err",
              "launch");
  auto report = [&](const char* name, double us, double err, const char* p) {
    char e[32];
    if (err < 0) std::snprintf(e, sizeof e, "-");
    else std::snprintf(e, sizeof e, "%.2e", err);
    std::printf("%-34s %7.2f us %7.3f TB/s  %-10s %s\n", name, us, bytes / (us * 1e-6) / 1e12, e, p);
  };
  char p[200];
  for (int round = 0; round < 2; ++round) {
    CKB(cudaMemcpyAsync(x, x0, H * 4, cudaMemcpyDeviceToDevice, L.stream));
    std::snprintf(p, sizeof p, "grid %d x %d", std::max(1, 2 * sms / slots), slots);
    report("read of the same bytes", time_graph(L, e0, e1, run_read), -1, p);
    const double em = check(run_mma);
    std::snprintf(p, sizeof p, "gate_up %d x %d smem %zu; down %d x %d thr smem %zu", g_mma.x, g_mma.y, m1, d_mma,
                  dw * 32, m2);
    report("tensor cores (both kernels)", time_graph(L, e0, e1, run_mma), em, p);
    if (takes) {
      auto one = [&](const char* name, auto kern, const XPlan& P, int ready) {
        sel_ready = ready;
        const auto run = both(gu_smem(kern, P), dn_mma_f);
        const double ex = check(run);
        std::snprintf(p, sizeof p, "gate_up %d x %d (%d/SM) smem %zu; down as above", P.grid.x, P.grid.y, P.per_sm,
                      P.smem);
        report(name, time_graph(L, e0, e1, run), ex, p);
        sel_ready = 0;
      };
      one("gu rows R 1, down early (production)", gate_up_fp8_smem_kernel<1>, g1, 1);
      one("gu rows R 1, down after its wait", gate_up_fp8_smem_kernel<1>, g1, 0);
      one("gu rows R 2, down early", gate_up_fp8_smem_kernel<2>, g2, 1);
      one("gu rows R 2, down after its wait", gate_up_fp8_smem_kernel<2>, g2, 0);
      one("gu rows R 4, down early", gate_up_fp8_smem_kernel<4>, g4, 1);
      report("  gate_up rows alone, R 1", time_graph(L, e0, e1, gu_smem(gate_up_fp8_smem_kernel<1>, g1)), -1, "");
      report("  mma gate_up alone", time_graph(L, e0, e1, gu_mma_f), -1, "");
      report("  mma down alone", time_graph(L, e0, e1, dn_mma_f), -1, "");
    } else {
      std::printf("gate_up by rows: f8x_gate_up_takes refused the shape\n");
    }
  }
  return 0;
}
