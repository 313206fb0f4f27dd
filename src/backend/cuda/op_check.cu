// Single decode-step kernels on host data (op_check.h): each call uploads
// its inputs, launches the kernel as the decode step does (launch.cuh,
// without PDL: nothing runs before it) and copies the outputs back.
#include "backend/cuda/op_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/delta_cluster.cuh"
#include "backend/cuda/few_rows_experts.cuh"
#include "backend/cuda/device_model.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/gguf_dense_matvec.cuh"
#include "backend/cuda/gguf_dense_repack.cuh"
#include "backend/cuda/gguf_chunk_experts.cuh"
#include "backend/cuda/gguf_kernels.cuh"
#include "backend/cuda/gguf_staged.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/fp8_experts.cuh"
#include "backend/cuda/fp8_matvec.cuh"
#include "backend/cuda/fp8_rows.cuh"
#include "backend/cuda/fp8_gate_up_smem.cuh"
#include "backend/cuda/quant_experts.cuh"
#include "backend/cuda/router.cuh"
#include "core/dtype.h"
#include "core/error.h"

namespace flashmoe::cuda_ops {

using namespace flashmoe::cuda;

namespace {

// Device buffers of one call, freed when it returns (or throws).
struct Buffers {
  std::vector<void*> p;
  ~Buffers() {
    for (void* q : p) cudaFree(q);
  }
  template <typename T>
  T* up(const T* host, size_t n) {
    void* d = dev_alloc(n * sizeof(T), "op check");
    p.push_back(d);
    CK(cudaMemcpy(d, host, n * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T*>(d);
  }
  template <typename T>
  T* zeros(size_t n) {
    void* d = dev_alloc(n * sizeof(T), "op check");
    p.push_back(d);
    CK(cudaMemset(d, 0, n * sizeof(T)));
    return static_cast<T*>(d);
  }
};

template <typename T>
std::vector<T> down(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

Launcher device() {
  std::string why;
  if (!CudaModel::available(&why)) fail_device(DeviceFailure::Unavailable, "no usable CUDA device: " + why);
  CK(cudaSetDevice(0));
  Launcher l;
  CK(cudaGetDeviceProperties(&l.prop, 0));
  return l;
}

// W's block scales one row at a time ([row][block]), appended to out: as
// the upload keeps a DT_FP8 matrix's scales (DMat::row_scales).
void append_row_scales(const Matrix& W, std::vector<float>& out) {
  for (int64_t r = 0; r < W.rows; ++r)
    for (int64_t c = 0; c < W.blocks_per_row(); ++c) out.push_back(W.block_scale(r, c));
}

// The FP8 matvec (matvec_fp8_kernel) as CudaModel::Impl::matvec_fp8 runs
// it, on W laid out as upload_fp8_rows writes a DT_FP8 matrix; `per` rows
// per warp at a time.
std::vector<float> matvec_fp8(Launcher& l, const Matrix& W, const std::vector<float>& x,
                              const std::vector<float>& norm_w, float eps, int per) {
  if (W.cols % 16 || W.group % 16) fail("op check: FP8 matvec needs columns and block width in multiples of 16");
  DMat m;
  m.dt = DT_FP8;
  m.rows = int(W.rows);
  m.cols = int(W.cols);
  m.group = W.group;
  const int rows = m.rows, cols = m.cols;
  std::vector<uint8_t> host(m.bytes(), 0);
  std::memcpy(host.data(), W.data, W.nbytes());
  std::vector<float> sc;
  append_row_scales(W, sc);
  std::memcpy(host.data() + m.scale_offset(), sc.data(), sc.size() * 4);
  Buffers b;
  const uint8_t* dW = b.up(host.data(), host.size());
  const float* dx = b.up(x.data(), x.size());
  const float* dn = norm_w.empty() ? nullptr : b.up(norm_w.data(), norm_w.size());
  float* dy = b.zeros<float>(size_t(rows));
  if (const int split = f8_rows_split(cols, m.group)) {  // whole rows per warp, as CudaModel::Impl::matvec_fp8
    const size_t smem = f8_rows_smem(cols);
    const void* fn = reinterpret_cast<const void*>(matvec_fp8_rows_kernel);
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int rpb = kWarps / split, groups = (rows + kF8RowsR - 1) / kF8RowsR;
    const int blocks = std::min((groups + rpb - 1) / rpb, l.prop.multiProcessorCount * l.per_sm(fn, smem));
    l.go(matvec_fp8_rows_kernel, blocks, kThreads, smem, dW, reinterpret_cast<const float*>(dW + m.scale_offset()),
         m.group, rows, cols, dx, dn, eps, dy, 0, split, static_cast<float*>(nullptr));
    CK(cudaDeviceSynchronize());
    return down(dy, size_t(rows));
  }
  if (m.group % kF8Step == 0) {  // the tensor cores, as CudaModel::Impl::matvec_fp8
    const int split = f8_mma_split(rows, cols, l.prop.multiProcessorCount), tpb = kWarps / split;
    const size_t smem = f8_mma_matvec_smem(cols, f8_norm_fused(dn, cols));
    if (smem > 48 * 1024)
      CK(cudaFuncSetAttribute(matvec_fp8_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int tiles = (rows + 15) / 16;
    const int blocks = std::min((tiles + tpb - 1) / tpb,
                                l.prop.multiProcessorCount *
                                    l.per_sm(reinterpret_cast<const void*>(matvec_fp8_mma_kernel), smem));
    l.go(matvec_fp8_mma_kernel, blocks, kThreads, smem, dW, reinterpret_cast<const float*>(dW + m.scale_offset()),
         m.group, rows, cols, dx, dn, eps, dy, 0, split, 1, static_cast<float*>(nullptr));
    CK(cudaDeviceSynchronize());
    return down(dy, size_t(rows));
  }
  const int split = l.split_for(rows, cols, 16);
  const int rpb = kWarps / split;
  const size_t smem = dn ? size_t(cols) * 4 : 0;
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(matvec_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int blocks = std::min((rows + rpb - 1) / rpb,
                              l.prop.multiProcessorCount * l.per_sm(reinterpret_cast<const void*>(matvec_fp8_kernel), smem));
  const int pf = l.pf_rows(size_t(rows) * cols, rows, blocks, rpb);
  l.go(matvec_fp8_kernel, blocks, kThreads, smem, dW, reinterpret_cast<const float*>(dW + m.scale_offset()), m.group,
       rows, cols, dx, dn, eps, dy, 0, split, pf, per, static_cast<float*>(nullptr));
  CK(cudaDeviceSynchronize());
  return down(dy, size_t(rows));
}

}  // namespace

std::vector<float> matvec(const Matrix& W, const std::vector<float>& x, const std::vector<float>& norm_w, float eps,
                          bool three_rows) {
  Launcher l = device();
  if (W.fp8()) return matvec_fp8(l, W, x, norm_w, eps, three_rows ? 3 : 4);
  if (W.quantized()) fail("op check: matvec takes bf16, f16, f32 or FP8 block weights");
  const int dt = dt_of(W.dtype), rows = int(W.rows), cols = int(W.cols);
  Buffers b;
  const void* dW = b.up(static_cast<const uint8_t*>(W.data), W.nbytes());
  const float* dx = b.up(x.data(), x.size());
  const float* dn = norm_w.empty() ? nullptr : b.up(norm_w.data(), norm_w.size());
  float* dy = b.zeros<float>(size_t(rows));
  // As CudaModel::Impl::matvec.
  const int split = l.split_for(rows, cols, int(16 / dt_size(dt)));
  const int rpb = kWarps / split;
  const size_t smem = dn ? size_t(cols) * 4 : 0;
  auto run = [&](auto kern, auto* w) {
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int per = l.per_sm(reinterpret_cast<const void*>(kern), smem);
    const int blocks = std::min((rows + rpb - 1) / rpb, l.prop.multiProcessorCount * per);
    const int pf = l.pf_rows(W.nbytes(), rows, blocks, rpb);
    l.go(kern, blocks, kThreads, smem, w, rows, cols, dx, dn, eps, dy, 0, split, pf, three_rows ? 3 : 2,
         static_cast<float*>(nullptr));
  };
  switch (dt) {
    case DT_F32: run(matvec_kernel<float>, static_cast<const float*>(dW)); break;
    case DT_F16: run(matvec_kernel<__half>, static_cast<const __half*>(dW)); break;
    default: run(matvec_kernel<__nv_bfloat16>, static_cast<const __nv_bfloat16*>(dW));
  }
  CK(cudaDeviceSynchronize());
  return down(dy, size_t(rows));
}

void topk(const std::vector<float>& logits, int E, int k, bool norm, bool shared, std::vector<int>* ids,
          std::vector<float>* w) {
  device();
  if (E > 512 || k > 32 || k > E) fail("op check: top-k needs E <= 512 and k <= min(32, E)");
  Buffers b;
  const float* dl = b.up(logits.data(), logits.size());
  int* di = b.zeros<int>(size_t(k));
  float* dw = b.zeros<float>(size_t(k) + 1);
  topk_kernel<<<1, 32>>>(dl, E, k, norm ? 1 : 0, shared ? 1 : 0, di, dw, TierCount{nullptr, nullptr, nullptr},
                         ExpertSel{nullptr, nullptr, nullptr});
  check(cudaGetLastError(), "topk_kernel");
  CK(cudaDeviceSynchronize());
  *ids = down(di, size_t(k));
  *w = down(dw, size_t(k) + (shared ? 1 : 0));
}

std::vector<float> delta_step(DeltaStep& d, bool cluster) {
  Launcher l = device();
  const int nk = d.nk, nv = d.nv, dk = d.dk, dv = d.dv;
  // The kernels read z, b and a at offsets into one projection buffer.
  std::vector<float> proj(d.z);
  proj.insert(proj.end(), d.b.begin(), d.b.end());
  proj.insert(proj.end(), d.a.begin(), d.a.end());
  Buffers b;
  DeltaArgs a;
  a.conv = b.up(d.conv.data(), d.conv.size());
  a.proj = b.up(proj.data(), proj.size());
  a.zoff = 0;
  a.boff = nv * dv;
  a.aoff = nv * dv + nv;
  a.dt_bias = b.up(d.dt_bias.data(), d.dt_bias.size());
  a.neg_exp_A = b.up(d.neg_exp_A.data(), d.neg_exp_A.size());
  a.norm_w = b.up(d.norm_w.data(), d.norm_w.size());
  a.S = b.up(d.S.data(), d.S.size());
  a.out = b.zeros<float>(size_t(nv) * dv);
  a.nk = nk;
  a.nv = nv;
  a.dk = dk;
  a.dv = dv;
  a.eps = d.eps;
  if (cluster) {
    // As CudaModel::Impl::delta_cluster with force_small_delta_clusters.
    constexpr int cpb = 8;
    if (dv % cpb || dv / cpb > 8) fail("op check: the delta cluster needs dv a multiple of 8 up to 64");
    l.cluster_next = dv / cpb;
    const dim3 grid(unsigned(nv * (dv / cpb)));
    if (dk == 128) l.go(delta_cluster_kernel<128, cpb, 8>, grid, 64, 0, a);
    else if (dk == 64) l.go(delta_cluster_kernel<64, cpb, 8>, grid, 64, 0, a);
    else if (dk == 32) l.go(delta_cluster_kernel<32, cpb, 8>, grid, 64, 0, a);
    else fail("op check: the delta cluster needs dk 32, 64 or 128");
  } else {
    // As CudaModel::Impl::delta_net's fallback.
    const size_t smem = size_t(2 * dk) * 4;
    auto th = [&](int split) { return std::min(1024, std::max(32, (dv * split + 31) / 32 * 32)); };
    if (dk == 128 && dv * 4 <= 1024) l.go(delta_kernel<128, 4>, nv, th(4), smem, a);
    else if (dk == 64 && dv * 2 <= 1024) l.go(delta_kernel<64, 2>, nv, th(2), smem, a);
    else if (dk == 32) l.go(delta_kernel<32, 1>, nv, th(1), smem, a);
    else l.go(delta_kernel<0, 1>, nv, th(1), smem, a);
  }
  CK(cudaDeviceSynchronize());
  d.S = down(a.S, d.S.size());
  return down(a.out, size_t(nv) * dv);
}

std::vector<float> attention(const AttnDecode& in, int split, bool prefetch) {
  Launcher l = device();
  const int nh = in.nh, nkv = in.nkv, hd = in.hd, n = in.n;
  if (split > 1 && (hd % 8 || hd > 256)) fail("op check: split attention needs hd a multiple of 8 up to 256");
  Buffers b;
  // The decode step's gate sits in the q/k/v projection, after each head's q.
  std::vector<float> gate(size_t(nh) * 2 * hd, 0.f);
  for (int h = 0; h < nh; ++h)
    for (int d = 0; d < hd; ++d) gate[size_t(h) * 2 * hd + hd + d] = in.gate[size_t(h) * hd + d];
  const size_t cnt = size_t(n) * nkv * hd;
  KvLayer kv{};
  int kvt = KV_F32;
  if (in.kv == KvStore::F32) {
    kv.k = b.up(in.k.data(), cnt);
    kv.v = b.up(in.v.data(), cnt);
  } else {
    const bool bf = in.kv == KvStore::BF16;
    kvt = bf ? KV_BF16 : KV_F16;
    std::vector<uint16_t> k16(cnt), v16(cnt);
    for (size_t i = 0; i < cnt; ++i) {
      k16[i] = bf ? f32_to_bf16(in.k[i]) : f32_to_f16(in.k[i]);
      v16[i] = bf ? f32_to_bf16(in.v[i]) : f32_to_f16(in.v[i]);
    }
    kv.k = b.up(k16.data(), cnt);
    kv.v = b.up(v16.data(), cnt);
  }
  kv.ks = b.zeros<float>(1);  // fp8 scales: not read for these types
  kv.vs = b.zeros<float>(1);
  kv.cap = n;
  const int pos = n - 1;
  AttnArgs a;
  a.q = b.up(in.q.data(), in.q.size());
  a.gate = b.up(gate.data(), gate.size());
  a.scores = b.zeros<float>(size_t(nh) * n);
  a.out = b.zeros<float>(size_t(nh) * hd);
  a.pos = b.up(&pos, 1);
  a.kv = kv;
  a.nh = nh;
  a.nkv = nkv;
  a.hd = hd;
  a.ns = 0;
  a.scale = 1.0f / std::sqrt(float(hd));
  a.prefetch = prefetch ? 1 : 0;
  a.split = split;
  // As CudaModel::Impl::attention.
  const int groups = std::max(8, 256 / hd);
  const size_t smem = size_t(2 * hd + groups * hd) * 4;
  l.cluster_next = split;
  switch (kvt) {
    case KV_F32: l.go(attn_kernel<KV_F32>, nh * split, 256, smem, a); break;
    case KV_BF16: l.go(attn_kernel<KV_BF16>, nh * split, 256, smem, a); break;
    default: l.go(attn_kernel<KV_F16>, nh * split, 256, smem, a); break;
  }
  CK(cudaDeviceSynchronize());
  return down(a.out, size_t(nh) * hd);
}

std::vector<float> quant_experts(const std::vector<QuantExpert>& experts, const std::vector<float>& w,
                                 const std::vector<float>& x, const std::vector<float>& norm_w, float eps,
                                 const QuantExpert* shared) {
  Launcher l = device();
  const int k = int(experts.size()), H = int(x.size());
  if (k < 1 || k > 32) fail("op check: 1 to 32 experts");
  const Matrix& g0 = experts[0].gate;
  const int bits = quant_bits(g0.quant), group = g0.group, I = int(g0.rows);
  if (g0.fp8() ? H % 16 || I % 16 || group % 16 || g0.block_row0
               : !bits || H % (128 / bits) || I % (128 / bits) || group % 8)
    fail("op check: q8/q4 experts with sizes a multiple of 128 / bits, groups a multiple of 8; fp8 experts with "
         "sizes and block columns a multiple of 16");
  if (shared && (!g0.fp8() || !shared->gate.fp8() || shared->gate.group != shared->down.group ||
                 shared->gate.group % 16 || shared->gate.cols != H || w.size() != size_t(k) + 1))
    fail("op check: a shared expert beside FP8 experts in FP8 blocks a multiple of 16 wide, with a weight");
  const QExpert q = g0.fp8() ? make_fp8expert(group, g0.block_rows, H, I) : make_qexpert(bits, group, H, I);
  // Each expert's gate/up and down blocks in the device layout (as the upload writes them).
  Buffers b;
  std::vector<const void*> gu_tab, dn_tab;
  auto put = [](std::vector<uint8_t>& blk, const Matrix& m, size_t wo, size_t so, size_t bo) {
    std::memcpy(blk.data() + wo, m.data, m.nbytes());
    if (m.fp8()) {
      std::memcpy(blk.data() + so, m.block_scales, m.block_scale_bytes());
      return;
    }
    std::memcpy(blk.data() + so, m.scales, m.scale_bytes());
    std::memcpy(blk.data() + bo, m.biases, m.scale_bytes());
  };
  for (const QuantExpert& e : experts) {
    std::vector<uint8_t> gu(q.gu_bytes, 0), dn(q.dn_bytes, 0);
    put(gu, e.gate, 0, q.gate_s, q.gate_b);
    put(gu, e.up, q.up_w, q.up_s, q.up_b);
    put(dn, e.down, 0, q.dn_s, q.dn_b);
    gu_tab.push_back(b.up(gu.data(), gu.size()));
    dn_tab.push_back(b.up(dn.data(), dn.size()));
  }
  std::vector<int> ids(static_cast<size_t>(k));
  for (int j = 0; j < k; ++j) ids[size_t(j)] = j;
  MoeArgs a{};
  a.gu_tab = b.up(gu_tab.data(), gu_tab.size());
  a.down_tab = b.up(dn_tab.data(), dn_tab.size());
  a.ids = b.up(ids.data(), ids.size());
  // The chosen experts' rows as the decode step's pick publishes them, final
  // before gate_up (as with the folded router's preselection).
  std::vector<const void*> sel(size_t(2 * k));
  for (int j = 0; j < k; ++j) sel[size_t(j)] = gu_tab[size_t(j)], sel[size_t(k + j)] = dn_tab[size_t(j)];
  a.sel = b.up(sel.data(), sel.size());
  a.sel_ready = 1;
  a.w = b.up(w.data(), w.size());
  a.k = k;
  a.I = I;
  a.Is = 0;
  a.H = H;
  a.maxI = I;
  a.has_shared = 0;
  if (shared) {
    // Stacked rows (gate then up) as DT_FP8: codes, and per-row block scales.
    auto rows_fp8 = [&b](std::vector<const Matrix*> parts, const float** scales) {
      std::vector<uint8_t> codes;
      std::vector<float> sc;
      for (const Matrix* m : parts) {
        const uint8_t* d = static_cast<const uint8_t*>(m->data);
        codes.insert(codes.end(), d, d + m->nbytes());
        append_row_scales(*m, sc);
      }
      *scales = b.up(sc.data(), sc.size());
      return static_cast<const void*>(b.up(codes.data(), codes.size()));
    };
    a.s_gu = rows_fp8({&shared->gate, &shared->up}, &a.s_gu_sc);
    a.s_down = rows_fp8({&shared->down}, &a.s_down_sc);
    a.s_group = shared->gate.group;
    a.Is = int(shared->gate.rows);
    a.maxI = std::max(I, a.Is);
    a.has_shared = 1;
  }
  a.norm_w = b.up(norm_w.data(), norm_w.size());
  a.eps = eps;
  a.x = b.up(x.data(), x.size());
  a.hb = b.zeros<float>(size_t(k + a.has_shared) * a.maxI);
  const int slots = k + a.has_shared;
  // As CudaModel::Impl::moe_launch_q.
  const int blocks = std::min((H + kWarps - 1) / kWarps, l.prop.multiProcessorCount * kBlocksPerSm);
  const size_t s1 = size_t(H) * 4 * 2 + size_t(H) / 8 * 4, s2 = size_t(k) * I * 4 + size_t(k) * I / 8 * 4;
  auto run = [&](auto gu, auto dn) {
    if (s1 > 48 * 1024) CK(cudaFuncSetAttribute(gu, cudaFuncAttributeMaxDynamicSharedMemorySize, int(s1)));
    if (s2 > 48 * 1024) CK(cudaFuncSetAttribute(dn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(s2)));
    const int resident = l.per_sm(reinterpret_cast<const void*>(gu), s1) * l.prop.multiProcessorCount;
    const dim3 g1(std::max(1, std::min((I + kWarps - 1) / kWarps, resident / k)), k);
    l.go(gu, g1, kThreads, s1, a, q);
    l.go(dn, blocks, kThreads, s2, a, q);
  };
  const bool f8s = shared != nullptr;
  const int sms = l.prop.multiProcessorCount;
  if (q.fp8 && q.group % kF8Step == 0 && (!f8s || a.s_group % kF8Step == 0)) {
    // The tensor cores, as CudaModel::Impl::moe_launch_q<0>.
    auto mma = [&](auto gu, auto dn) {
      const int dw = f8_down_warps(a, f8s);
      const size_t m1 = f8_mma_gate_up_smem(H, f8_gate_up_xf(a, f8s)), m2 = f8_mma_down_smem(k, I, a.Is, f8s, dw);
      if (m1 > 48 * 1024) CK(cudaFuncSetAttribute(gu, cudaFuncAttributeMaxDynamicSharedMemorySize, int(m1)));
      if (m2 > 48 * 1024) CK(cudaFuncSetAttribute(dn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(m2)));
      if (f8x_gate_up_takes(a, q, f8s, size_t(l.prop.sharedMemPerBlockOptin) - 4096)) {
        launch_gate_up_fp8_smem(l, a, q, slots);  // gate_up by whole rows through shared memory
      } else {
        const int resident = l.per_sm(reinterpret_cast<const void*>(gu), m1) * sms;
        const int tpb = kWarps / kGuSplit, need = ((a.maxI + 7) / 8 + tpb - 1) / tpb;
        l.go(gu, dim3(std::max(1, std::min(need, resident / slots)), slots), kThreads, m1, a, q);
      }
      const int dres = l.per_sm(reinterpret_cast<const void*>(dn), m2, dw * 32) * sms;
      l.go(dn, std::min((H + 15) / 16, dres), dw * 32, m2, a, q);
    };
    if (f8s) mma(gate_up_fp8_mma_kernel<F8Rows>, down_fp8_mma_kernel<F8Rows>);
    else mma(gate_up_fp8_mma_kernel<__nv_bfloat16>, down_fp8_mma_kernel<__nv_bfloat16>);
  } else if (q.fp8 && f8s) {
    fail("op check: an FP8 shared expert on the FFMA kernels is not checked here");
  } else if (q.fp8) run(gate_up_fp8_kernel<__nv_bfloat16>, down_fp8_kernel<__nv_bfloat16>);
  else if (bits == 8) run(gate_up_q_kernel<8, __nv_bfloat16>, down_q_kernel<8, __nv_bfloat16>);
  else run(gate_up_q_kernel<4, __nv_bfloat16>, down_q_kernel<4, __nv_bfloat16>);
  CK(cudaDeviceSynchronize());
  return down(a.x, size_t(H));
}

namespace {
GMat one_part(const Matrix& W) {
  if (!W.block_quantized()) fail("op check: the GGUF kernels take a GGUF block format");
  GMat g;
  g.n = 1;
  g.row0[1] = int(W.rows);
  g.kind[0] = int(W.quant);
  return g;
}
}  // namespace

// A copy of the GGUF blocks of W on the device, its end padded to 16 bytes
// as upload.cu pads every part (the staged kernels copy whole 16-byte units).
static const void* up_blocks(Buffers& b, const Matrix& W) {
  std::vector<uint8_t> pad((W.nbytes() + 15) / 16 * 16, 0);
  std::memcpy(pad.data(), W.data, W.nbytes());
  return b.up(pad.data(), pad.size());
}

std::vector<float> gguf_matvec(const Matrix& W, const std::vector<float>& x, bool staged) {
  Launcher l = device();
  const GMat g = one_part(W);
  const int rows = int(W.rows), cols = int(W.cols);
  Buffers b;
  const void* dW = up_blocks(b, W);
  const float* dx = b.up(x.data(), x.size());
  float* dy = b.zeros<float>(size_t(rows));
  if (staged) {  // as CudaModel::Impl::matvec
    const GStage st = gstage_plan(g, cols, l.prop.multiProcessorCount * kBlocksPerSm * kWarps);
    const size_t smem = gmatvec_staged_smem(st, cols);
    if (smem > 48 * 1024)
      CK(cudaFuncSetAttribute(gmatvec_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int runs = (rows + st.R[0] - 1) / st.R[0];
    const int blocks =
        std::min((runs + kWarps - 1) / kWarps,
                 l.prop.multiProcessorCount * l.per_sm(reinterpret_cast<const void*>(gmatvec_staged_kernel), smem));
    l.go(gmatvec_staged_kernel, blocks, kThreads, smem, dW, g, st, cols, dx, static_cast<const float*>(nullptr), 0.0f,
         dy, 0, static_cast<float*>(nullptr));
  } else {
    const size_t smem = size_t(cols) * 4;  // as CudaModel::Impl::matvec
    if (smem > 48 * 1024)
      CK(cudaFuncSetAttribute(gmatvec_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int blocks =
        std::min((rows + kWarps - 1) / kWarps,
                 l.prop.multiProcessorCount * l.per_sm(reinterpret_cast<const void*>(gmatvec_kernel), smem));
    l.go(gmatvec_kernel, blocks, kThreads, smem, dW, g, rows, cols, dx, static_cast<const float*>(nullptr), 0.0f, dy,
         0, static_cast<float*>(nullptr));
  }
  CK(cudaDeviceSynchronize());
  return down(dy, size_t(rows));
}

// The parts stacked as the upload stacks them (gmat_stack), repacked or not, on the device.
static const void* up_stacked(Buffers& b, const std::vector<Matrix>& parts, bool repack, GMat& g) {
  size_t bytes = 0;
  g = gmat_stack(parts, repack, bytes);
  std::vector<uint8_t> h(bytes, 0);
  const int cols = int(parts.at(0).cols);
  for (int i = 0; i < g.n; ++i) {
    const Matrix& p = parts[size_t(i)];
    if (repack) gdense_repack_rows(int(p.quant), static_cast<const uint8_t*>(p.data), int(p.rows), cols, h.data() + g.off[i]);
    else std::memcpy(h.data() + g.off[i], p.data, p.nbytes());
  }
  return b.up(h.data(), h.size());
}

std::vector<float> gguf_experts(const std::vector<GgufExpert>& experts, const std::vector<float>& logits, int k,
                                const std::vector<float>& x, const std::vector<float>& norm_w, float eps,
                                std::vector<int>* ids, std::vector<float>* w, bool chunks, const GgufExpert* shared,
                                bool shared_chunks) {
  Launcher l = device();
  const int E = int(experts.size());
  if (E < 1 || k < 1 || k > E || k >= kDownSlotsMax || logits.size() != size_t(E + (shared ? 1 : 0)) || E > 512)
    fail("op check: GGUF experts: sizes");
  if (shared && !chunks) fail("op check: GGUF experts: a shared expert is checked on the chunk kernels only");
  if (shared_chunks && !shared) fail("op check: GGUF experts: shared_chunks without a shared expert");
  const GgufExpert& e0 = experts[0];
  const int H = int(e0.gate.cols), I = int(e0.gate.rows);
  // An expert's blocks as upload.cu lays them out (gguf_expert_layout).
  auto up16 = [](size_t v) { return (v + 15) / 16 * 16; };
  GExperts ge;
  ge.gu.n = 2;
  ge.gu.row0[1] = I, ge.gu.row0[2] = 2 * I;
  ge.gu.kind[0] = int(e0.gate.quant), ge.gu.kind[1] = int(e0.up.quant);
  ge.gu.off[1] = up16(e0.gate.nbytes());
  const size_t gu_bytes = up16(ge.gu.off[1] + e0.up.nbytes()), dn_bytes = up16(e0.down.nbytes());
  ge.dn.n = 1;
  ge.dn.row0[1] = H;
  ge.dn.kind[0] = int(e0.down.quant);
  std::vector<uint8_t> gu(size_t(E) * gu_bytes, 0), dn(size_t(E) * dn_bytes, 0);
  for (int e = 0; e < E; ++e) {
    const GgufExpert& x_e = experts[size_t(e)];
    if (x_e.gate.quant != e0.gate.quant || x_e.up.quant != e0.up.quant || x_e.down.quant != e0.down.quant ||
        x_e.gate.rows != I || x_e.up.rows != I || x_e.down.rows != H || x_e.down.cols != I)
      fail("op check: GGUF experts: every expert's shapes and kinds alike");
    std::memcpy(gu.data() + size_t(e) * gu_bytes, x_e.gate.data, x_e.gate.nbytes());
    std::memcpy(gu.data() + size_t(e) * gu_bytes + ge.gu.off[1], x_e.up.data, x_e.up.nbytes());
    std::memcpy(dn.data() + size_t(e) * dn_bytes, x_e.down.data, x_e.down.nbytes());
  }
  Buffers b;
  const uint8_t *dgu, *ddn;
  size_t gu_stride = gu_bytes, dn_stride = dn_bytes;
  const GExperts stored = ge;
  if (chunks) {  // as upload.cu: staged as stored, rearranged on the device
    GExperts c = ge;
    if (!gc_expert_layout(ge.gu, ge.dn, H, I, c.gu, c.dn, gu_stride, dn_stride))
      fail("op check: GGUF experts: no chunk layout for these kinds or shapes");
    uint8_t* cgu = b.zeros<uint8_t>(size_t(E) * gu_stride);
    uint8_t* cdn = b.zeros<uint8_t>(size_t(E) * dn_stride);
    GcScratch scratch;
    gc_upload_experts(gu.data(), gu_bytes, ge.gu, cgu, gu_stride, c.gu, H, E, scratch);
    gc_upload_experts(dn.data(), dn_bytes, ge.dn, cdn, dn_stride, c.dn, I, E, scratch);
    ge = c;
    dgu = cgu, ddn = cdn;
  } else {
    dgu = b.up(gu.data(), gu.size());
    ddn = b.up(dn.data(), dn.size());
  }
  std::vector<const void*> gu_tab, dn_tab;
  for (int e = 0; e < E; ++e) {
    gu_tab.push_back(dgu + size_t(e) * gu_stride);
    dn_tab.push_back(ddn + size_t(e) * dn_stride);
  }
  MoeArgs a{};
  a.gu_tab = b.up(gu_tab.data(), gu_tab.size());
  a.down_tab = b.up(dn_tab.data(), dn_tab.size());
  const void** sel = b.zeros<const void*>(size_t(2 * k));
  int* dids = b.zeros<int>(size_t(k));
  float* dw = b.zeros<float>(size_t(k + 1));
  a.ids = dids;
  a.sel = sel;
  a.w = dw;
  a.k = k;
  a.I = I;
  a.Is = 0;
  a.H = H;
  a.maxI = I;
  a.has_shared = 0;
  a.norm_w = b.up(norm_w.data(), norm_w.size());
  a.eps = eps;
  a.x = b.up(x.data(), x.size());
  a.hb = b.zeros<float>(size_t(k) * I);
  a.logits = b.up(logits.data(), logits.size());
  a.E = E;
  a.norm_topk = 1;
  a.tc = TierCount{nullptr, nullptr, nullptr};
  a.tsel = ExpertSel{a.gu_tab, a.down_tab, sel};
  a.ids_out = dids;
  a.w_out = dw;
  uint8_t *sgu_chunks = nullptr, *sdn_chunks = nullptr;  // the shared expert in the chunk layout, if copied
  if (shared) {  // stored rows, as upload.cu uploads a shared expert (upload_rows, not repacked)
    a.s_gu = up_stacked(b, {shared->gate, shared->up}, false, ge.sgu);
    a.s_down = up_stacked(b, {shared->down}, false, ge.sdn);
    a.Is = int(shared->gate.rows);
    a.maxI = std::max(I, a.Is);
    a.has_shared = 1;
    a.hb = b.zeros<float>(size_t(k + 1) * a.maxI);
    if (shared_chunks) {  // as upload.cu: a copy in the routed experts' chunk layout, read as they are
      GExperts s = stored;
      s.sgu = ge.sgu, s.sdn = ge.sdn;
      if (!gc_shared_joins(s, I, a.Is)) fail("op check: GGUF experts: this shared expert has no chunk layout");
      sgu_chunks = b.zeros<uint8_t>(gu_stride);
      sdn_chunks = b.zeros<uint8_t>(dn_stride);
      gc_copy_shared(a.s_gu, ge.sgu, a.s_down, ge.sdn, sgu_chunks, sdn_chunks, ge.gu, ge.dn, H, I);
    }
  }
  // As CudaModel::Impl::ffn_launch.
  if (chunks) {
    const size_t smem = size_t(l.prop.sharedMemPerBlockOptin) - 4096;
    if (!gc_experts_take(ge, H, I, k, smem)) fail("op check: GGUF experts: the chunk kernels do not take this layer");
    gc_allow_smem(int(smem));
    gc_experts_launch(l, a, ge, k + a.has_shared, sgu_chunks, sdn_chunks, [] {});
    CK(cudaDeviceSynchronize());
    *ids = down(dids, size_t(k));
    *w = down(dw, size_t(k + a.has_shared));
    return down(a.x, size_t(H));
  }
  const int S1 = ggate_up_stage_bytes(ge, H, k, false), S2 = gdown_stage_bytes(ge, I, 0, k, false);
  const size_t s1 = size_t(H) * 4 + 16 + size_t(kWarps) * 2 * S1, s2 = size_t(S2) * k;
  if (s1 > 48 * 1024)
    CK(cudaFuncSetAttribute(ggate_up_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(s1)));
  if (s2 > 48 * 1024)
    CK(cudaFuncSetAttribute(gdown_staged_kernel<kDownRun>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(s2)));
  const int resident =
      l.per_sm(reinterpret_cast<const void*>(ggate_up_staged_kernel), s1) * l.prop.multiProcessorCount;
  const dim3 g1(std::max(1, std::min((I + kWarps - 1) / kWarps, resident / k)), k);
  l.go(ggate_up_staged_kernel, g1, kThreads, s1, a, ge, S1);
  l.go(gdown_staged_kernel<kDownRun>, (H + kDownRun - 1) / kDownRun, k * 32, s2, a, ge, S2);
  CK(cudaDeviceSynchronize());
  *ids = down(dids, size_t(k));
  *w = down(dw, size_t(k));
  return down(a.x, size_t(H));
}

std::vector<float> gguf_dense_matvec(const std::vector<Matrix>& parts, const std::vector<float>& x,
                                     const std::vector<float>& norm_w, float eps, const std::vector<float>& y0) {
  Launcher l = device();
  const int cols = int(parts.at(0).cols);
  for (const Matrix& p : parts)
    if (p.cols != cols || !gdense_repackable(int(p.quant), cols)) fail("op check: gguf_dense_matvec: a part without a repacked form");
  Buffers b;
  GMat g;
  const void* dW = up_stacked(b, parts, true, g);
  const int rows = g.row0[g.n];
  const float* dx = b.up(x.data(), x.size());
  const float* dn = norm_w.empty() ? nullptr : b.up(norm_w.data(), norm_w.size());
  float* dy = y0.empty() ? b.zeros<float>(size_t(rows)) : b.up(y0.data(), y0.size());
  // As CudaModel::Impl::matvec.
  const size_t smem = gdense_smem(cols);
  if (smem > 48 * 1024)
    CK(cudaFuncSetAttribute(gdense_matvec_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int resident =
      l.prop.multiProcessorCount * l.per_sm(reinterpret_cast<const void*>(gdense_matvec_kernel), smem);
  const int split = gdense_split(g, cols, resident), rpb = kWarps / split;
  const int blocks = std::min((gdense_units(g) + rpb - 1) / rpb, resident);
  l.go(gdense_matvec_kernel, blocks, kThreads, smem, dW, g, cols, split, dx, dn, eps, dy, y0.empty() ? 0 : 1,
       static_cast<float*>(nullptr));
  CK(cudaDeviceSynchronize());
  return down(dy, size_t(rows));
}

std::vector<float> gguf_gemm(const Matrix& W, const std::vector<float>& A, int T, int bm, bool repacked) {
  device();
  GemmArgs a;
  Buffers b;
  a.W = up_stacked(b, {W}, repacked, a.gm);
  a.A = b.up(A.data(), A.size());
  a.lda = int(W.cols);
  a.M = T;
  a.N = int(W.rows);
  a.K = int(W.cols);
  a.C = b.zeros<float>(size_t(T) * W.rows);
  a.ldc = int(W.rows);
  const dim3 grid(unsigned((a.N + kGemmBN - 1) / kGemmBN), unsigned((T + bm - 1) / bm));
  if (bm == 64) gemm_kernel<GB, 64><<<grid, kGemmThreads>>>(a);
  else if (bm == 32) gemm_kernel<GB, 32><<<grid, kGemmThreads>>>(a);
  else gemm_kernel<GB, 16><<<grid, kGemmThreads>>>(a);
  check(cudaGetLastError(), "gemm_kernel<GB>");
  CK(cudaDeviceSynchronize());
  return down(a.C, size_t(T) * W.rows);
}

std::vector<float> few_rows_experts(const std::vector<DenseExpert>& experts, const std::vector<float>& x, int T,
                                    const std::vector<int>& ids, int k) {
  Launcher l = device();
  const int E = int(experts.size());
  if (E < 1 || k < 1 || T < 1 || ids.size() != size_t(T) * k) fail("op check: few-rows experts: sizes");
  const Matrix& g0 = experts[0].gate_up;
  const int H = int(g0.cols), I = int(g0.rows / 2);
  const int dt = g0.dtype == DType::F32 ? DT_F32 : g0.dtype == DType::F16 ? DT_F16 : DT_BF16;
  if (!few_rows_supported(dt, H, int(l.prop.sharedMemPerBlockOptin)) ||
      !few_rows_supported(dt, I, int(l.prop.sharedMemPerBlockOptin)))
    fail("op check: few-rows experts: a storage type or size few_rows_kernel does not take");
  Buffers b;
  std::vector<const void*> gu_tab, dn_tab;
  for (const DenseExpert& e : experts) {
    gu_tab.push_back(b.up(static_cast<const uint8_t*>(e.gate_up.data), e.gate_up.nbytes()));
    dn_tab.push_back(b.up(static_cast<const uint8_t*>(e.down.data), e.down.nbytes()));
  }
  // The list as route_lists_kernel orders it: by expert, each expert's
  // entries cut into tiles of kFewRows.
  std::vector<int> tok, dest, tiles;
  for (int e = 0; e < E; ++e) {
    const int first = int(tok.size());
    for (int i = 0; i < T * k; ++i)
      if (ids[size_t(i)] == e) tok.push_back(i / k), dest.push_back(i);
    for (int m = first; m < int(tok.size()); m += kFewRows)
      tiles.insert(tiles.end(), {e, m, std::min(int(tok.size()), m + kFewRows)});
  }
  if (int(tok.size()) != T * k) fail("op check: few-rows experts: an id outside the experts");
  const int ntiles = int(tiles.size() / 3);
  FewRowsArgs a;
  a.A = b.up(x.data(), x.size());
  a.lda = H;
  a.arow = b.up(tok.data(), tok.size());
  a.wtab = b.up(gu_tab.data(), gu_tab.size());
  a.tiles = b.up(tiles.data(), tiles.size());
  a.ntiles = b.up(&ntiles, 1);
  a.K = H;
  a.N = I;
  float* hb = b.zeros<float>(size_t(T) * k * I);
  a.C = hb;
  a.ldc = I;
  a.swiglu = 1;
  // Two more blocks than tiles along y: those must return without writing.
  check(launch_few_rows(dt, a, ntiles + 2, nullptr), "few_rows_kernel (gate/up)");
  a.A = hb;
  a.lda = I;
  a.arow = nullptr;
  a.wtab = b.up(dn_tab.data(), dn_tab.size());
  a.K = I;
  a.N = H;
  a.C = b.zeros<float>(size_t(T) * k * H);
  a.ldc = H;
  a.crow = b.up(dest.data(), dest.size());
  a.swiglu = 0;
  check(launch_few_rows(dt, a, ntiles + 2, nullptr), "few_rows_kernel (down)");
  CK(cudaDeviceSynchronize());
  return down(a.C, size_t(T) * k * H);
}

namespace {
// skinny_gemm's launch; with c_hi (and c_lo): A handed over as hi/lo rows, C's split rows out.
std::vector<float> skinny_gemm_run(const Matrix& W, const std::vector<float>& A, int T, int mode,
                                   const std::vector<float>& C0, std::vector<uint16_t>* c_hi,
                                   std::vector<uint16_t>* c_lo) {
  Launcher l = device();
  if (W.dtype != DType::BF16 || W.cols % 8 != 0 || T < 1 || T > kSkinnyMaxRows ||
      A.size() != size_t(T) * W.cols || (mode == GEMM_SWIGLU && W.rows % 2 != 0) ||
      !skinny_weights_fit(W.rows, W.cols))
    fail("op check: skinny product: a shape or storage type skinny_gemm_kernel does not take");
  const int ldc = int(mode == GEMM_SWIGLU ? W.rows / 2 : W.rows);
  if (C0.size() != size_t(T) * ldc) fail("op check: skinny product: C0 is not [T][ldc]");
  Buffers b;
  GemmArgs a;
  a.W = b.up(static_cast<const uint8_t*>(W.data), W.nbytes());
  a.A = b.up(A.data(), A.size());
  a.lda = int(W.cols);
  a.M = T;
  a.N = int(W.rows);
  a.K = int(W.cols);
  a.C = b.up(C0.data(), C0.size());
  a.ldc = ldc;
  a.mode = mode;
  a.half = mode == GEMM_SWIGLU ? ldc : 0;
  if (c_hi) {  // the activations given split, as the kernels before write them
    std::vector<uint16_t> hi(A.size()), lo(A.size());
    for (size_t i = 0; i < A.size(); ++i) {
      hi[i] = f32_to_bf16(A[i]);
      lo[i] = f32_to_bf16(A[i] - bf16_to_f32(hi[i]));
    }
    a.Ahi = reinterpret_cast<const __nv_bfloat16*>(b.up(hi.data(), hi.size()));
    a.Alo = reinterpret_cast<const __nv_bfloat16*>(b.up(lo.data(), lo.size()));
    a.A = nullptr;  // the kernel must not read it
    if (!skinny_split_given(a)) fail("op check: skinny product: the split rows are not 16-byte aligned rows");
    if (mode == GEMM_SWIGLU) {
      a.Chi = reinterpret_cast<__nv_bfloat16*>(b.zeros<uint16_t>(C0.size()));
      a.Clo = reinterpret_cast<__nv_bfloat16*>(b.zeros<uint16_t>(C0.size()));
    }
  }
  check(launch_skinny_gemm(a, l.prop.multiProcessorCount, nullptr), "skinny_gemm_kernel");
  CK(cudaDeviceSynchronize());
  if (a.Chi) {
    *c_hi = down(reinterpret_cast<const uint16_t*>(a.Chi), C0.size());
    *c_lo = down(reinterpret_cast<const uint16_t*>(a.Clo), C0.size());
  }
  return down(a.C, C0.size());
}
}  // namespace

std::vector<float> skinny_gemm(const Matrix& W, const std::vector<float>& A, int T, int mode,
                               const std::vector<float>& C0) {
  return skinny_gemm_run(W, A, T, mode, C0, nullptr, nullptr);
}

std::vector<float> skinny_gemm_split(const Matrix& W, const std::vector<float>& A, int T, int mode,
                                     const std::vector<float>& C0, std::vector<uint16_t>& c_hi,
                                     std::vector<uint16_t>& c_lo) {
  c_hi.clear();
  c_lo.clear();
  return skinny_gemm_run(W, A, T, mode, C0, &c_hi, &c_lo);
}

}  // namespace flashmoe::cuda_ops
