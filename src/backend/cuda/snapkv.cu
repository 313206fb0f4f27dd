// SnapKV on the GPU (--kv-snapkv B): the prompt runs whole through the
// batched prefill (full retention; Prefill::run keeps each layer's last
// kSnapObserved queries in a ring); at the first single-token step every
// full-attention layer scores its prompt positions by the attention of
// those queries (the CPU's sums: per query and head a softmax over the
// positions it saw, summed), the host picks the positions with the CPU's
// own rule (kv/snapkv_select.h) and the kept rows move to a cache of B
// slots, laid out as a streaming cache (KvLayer::shift) from then on.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/error.h"
#include "kv/snapkv_select.h"

namespace flashmoe {

namespace {

constexpr int kObs = int(KvConfig::kSnapObserved);

struct SnapArgs {
  KvLayer kv;
  const float* q;  // [kObs][nh*hd] ring: the query of position p at row p % kObs
  int n, nobs, nh, nkv, hd, ns;
  float scale;
  float* mx;       // [nobs][nh] each softmax's max logit
  double* z;       // [nobs][nh] its denominator
  double* score;   // [n]
};

// The logit of query (position t, head h) against slot s, computed by one
// warp (every lane gets it), the same bits wherever it is called: the CPU's
// dequantised key (code * scale) times q, times the attention scale.
template <int KVT>
__device__ __forceinline__ float snap_logit(const SnapArgs& a, int t, int h, int s) {
  const int kvh = h / (a.nh / a.nkv), lane = threadIdx.x & 31;
  const float* q = a.q + size_t(t % kObs) * a.nh * a.hd + size_t(h) * a.hd;
  const size_t off = size_t(s) * a.nkv * a.hd + size_t(kvh) * a.hd;
  float sc = 1.f;
  if constexpr (KVT == KV_FP8) sc = a.kv.ks[size_t(s) * a.ns + (a.ns == 1 ? 0 : kvh)];
  float d = 0.f;
  for (int i = lane; i < a.hd; i += 32) d += q[i] * (kv_load<KVT>(a.kv.k, off + i) * sc);
  return warp_sum(d) * a.scale;
}

// One block per (observed query j, head h): the max and the denominator of
// its softmax over slots [0, t], t = n - nobs + j.
template <int KVT>
__global__ void snap_stats_kernel(SnapArgs a) {
  __shared__ float wm[32];
  __shared__ double wz[32];
  const int j = blockIdx.x / a.nh, h = blockIdx.x % a.nh, t = a.n - a.nobs + j;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  float m = -INFINITY;
  for (int s = warp; s <= t; s += nw) m = fmaxf(m, snap_logit<KVT>(a, t, h, s));
  if (lane == 0) wm[warp] = m;
  __syncthreads();
  m = wm[0];
  for (int w = 1; w < nw; ++w) m = fmaxf(m, wm[w]);
  double z = 0;
  for (int s = warp; s <= t; s += nw) z += exp(double(snap_logit<KVT>(a, t, h, s) - m));
  if (lane == 0) wz[warp] = z;
  __syncthreads();
  if (threadIdx.x == 0) {
    double zt = 0;
    for (int w = 0; w < nw; ++w) zt += wz[w];
    a.mx[blockIdx.x] = m;
    a.z[blockIdx.x] = zt;
  }
}

// One block per slot s: its score, the sum of its probability under every
// observed query that saw it and every head.
template <int KVT>
__global__ void snap_score_kernel(SnapArgs a) {
  __shared__ double ws[32];
  const int s = blockIdx.x, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  double acc = 0;
  for (int jh = warp; jh < a.nobs * a.nh; jh += nw) {
    const int j = jh / a.nh, h = jh % a.nh, t = a.n - a.nobs + j;
    if (s > t) continue;
    acc += exp(double(snap_logit<KVT>(a, t, h, s) - a.mx[jh])) / a.z[jh];
  }
  if ((threadIdx.x & 31) == 0) ws[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0;
    for (int w = 0; w < nw; ++w) tot += ws[w];
    a.score[s] = tot;
  }
}

// Row keep[i] of src into slot i of dst (K, V bytes and the fp8 scales).
__global__ void snap_gather_kernel(KvLayer dst, KvLayer src, const int* keep, size_t row_bytes, int ns) {
  const int i = blockIdx.x, from = keep[i];
  const char* sk = static_cast<const char*>(src.k) + size_t(from) * row_bytes;
  const char* sv = static_cast<const char*>(src.v) + size_t(from) * row_bytes;
  char* dk = static_cast<char*>(dst.k) + size_t(i) * row_bytes;
  char* dv = static_cast<char*>(dst.v) + size_t(i) * row_bytes;
  for (size_t b = threadIdx.x; b < row_bytes; b += blockDim.x) dk[b] = sk[b], dv[b] = sv[b];
  if (int(threadIdx.x) < ns) {
    dst.ks[size_t(i) * ns + threadIdx.x] = src.ks[size_t(from) * ns + threadIdx.x];
    dst.vs[size_t(i) * ns + threadIdx.x] = src.vs[size_t(from) * ns + threadIdx.x];
  }
}

template <int KVT>
void launch_scores(const SnapArgs& a, cudaStream_t st) {
  snap_stats_kernel<KVT><<<unsigned(a.nobs * a.nh), 256, 0, st>>>(a);
  snap_score_kernel<KVT><<<unsigned(a.n), 256, 0, st>>>(a);
}

}  // namespace

void CudaModel::Impl::snapkv_begin_decode(CudaState::Impl& s) {
  if (!s.snap || s.snap_done) return;
  CK(cudaSetDevice(dev));
  const KvConfig& kv = s.kv;
  const int64_t n = s.pos, B = kv.snapkv_budget, R = kv.snapkv_recent();
  s.drop_graphs();
  const size_t row_bytes = size_t(s.nkv) * s.hd * s.el, nsc = size_t(std::max(s.ns, 1));
  // Every prompt position went through the batched prefill, which observed
  // the queries of the last min(n, kObs) of them.
  const int nobs = int(std::min<int64_t>(n, kObs));
  double* d_score = nullptr;
  float* d_mx = nullptr;
  double* d_z = nullptr;
  int* d_keep = nullptr;
  if (n > B) {
    d_score = static_cast<double*>(dev_alloc(size_t(n) * 8, "snapkv scores"));
    d_mx = static_cast<float*>(dev_alloc(size_t(nobs) * s.nh * 4, "snapkv scores"));
    d_z = static_cast<double*>(dev_alloc(size_t(nobs) * s.nh * 8, "snapkv scores"));
  }
  d_keep = static_cast<int*>(dev_alloc(size_t(B) * 4, "snapkv positions"));
  std::vector<double> score(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (size_t l = 0; l < s.kvl.size(); ++l) {
    KvLayer& L = s.kvl[l];
    std::vector<int64_t> keep;
    if (n > B) {
      SnapArgs a{L, s.snap_q[l], int(n), nobs, s.nh, s.nkv, s.hd, s.ns, 1.0f / std::sqrt(float(s.hd)), d_mx, d_z,
                 d_score};
      switch (s.kvt) {
        case KV_F32: launch_scores<KV_F32>(a, stream); break;
        case KV_BF16: launch_scores<KV_BF16>(a, stream); break;
        case KV_F16: launch_scores<KV_F16>(a, stream); break;
        default: launch_scores<KV_FP8>(a, stream); break;
      }
      CK(cudaGetLastError());
      CK(cudaMemcpyAsync(score.data(), d_score, size_t(n) * 8, cudaMemcpyDeviceToHost, stream));
      CK(cudaStreamSynchronize(stream));
      keep = snapkv_keep(score.data(), n, kv);
    } else {
      for (int64_t p = 0; p < n; ++p) keep.push_back(p);
    }
    std::vector<int> k32(keep.begin(), keep.end());
    KvLayer N = L;
    N.cap = int(B);
    N.window = int(B);
    N.sinks = int(B - R);
    N.shift = int(std::max<int64_t>(0, n - B));
    N.k = dev_alloc(size_t(B) * row_bytes, "KV cache");
    N.v = dev_alloc(size_t(B) * row_bytes, "KV cache");
    N.ks = static_cast<float*>(dev_alloc(size_t(B) * nsc * 4, "KV scales"));
    N.vs = static_cast<float*>(dev_alloc(size_t(B) * nsc * 4, "KV scales"));
    if (!k32.empty()) {
      CK(cudaMemcpyAsync(d_keep, k32.data(), k32.size() * 4, cudaMemcpyHostToDevice, stream));
      snap_gather_kernel<<<unsigned(k32.size()), 256, 0, stream>>>(N, L, d_keep, row_bytes, s.ns);
      CK(cudaGetLastError());
    }
    CK(cudaStreamSynchronize(stream));
    for (void* p : {L.k, L.v, static_cast<void*>(L.ks), static_cast<void*>(L.vs)}) cudaFree(p);
    L = N;
    // The positions of the kept prompt slots [0, B - R) (a prompt of n <= B:
    // slot p holds position p).
    std::vector<int64_t>& fixed = s.snap_fixed[l];
    fixed.clear();
    for (int64_t i = 0; i < B - R; ++i) fixed.push_back(n > B ? keep[size_t(i)] : i);
  }
  for (void* p : {static_cast<void*>(d_score), static_cast<void*>(d_mx), static_cast<void*>(d_z),
                  static_cast<void*>(d_keep)})
    cudaFree(p);
  snapkv_layout(s, std::max<int64_t>(0, n - B));
}

// Each layer's storage replaced by B empty slots in the cut layout.
void CudaModel::Impl::snapkv_restore(CudaState::Impl& s, int64_t shift) {
  CK(cudaSetDevice(dev));
  s.drop_graphs();
  const int64_t B = s.kv.snapkv_budget, R = s.kv.snapkv_recent();
  const size_t row_bytes = size_t(s.nkv) * s.hd * s.el, nsc = size_t(std::max(s.ns, 1));
  for (KvLayer& L : s.kvl) {
    for (void* p : {L.k, L.v, static_cast<void*>(L.ks), static_cast<void*>(L.vs)}) cudaFree(p);
    L.k = L.v = nullptr;
    L.ks = L.vs = nullptr;
    L.k = dev_alloc(size_t(B) * row_bytes, "KV cache");
    L.v = dev_alloc(size_t(B) * row_bytes, "KV cache");
    L.ks = static_cast<float*>(dev_alloc(size_t(B) * nsc * 4, "KV scales"));
    L.vs = static_cast<float*>(dev_alloc(size_t(B) * nsc * 4, "KV scales"));
    L.cap = int(B);
    L.window = int(B);
    L.sinks = int(B - R);
    L.shift = int(shift);
  }
  snapkv_layout(s, shift);
}

void CudaModel::Impl::snapkv_layout(CudaState::Impl& s, int64_t shift) {
  const int64_t B = s.kv.snapkv_budget, R = s.kv.snapkv_recent();
  for (float*& q : s.snap_q) {
    cudaFree(q);
    q = nullptr;
  }
  cudaFree(s.scores);
  s.scores = nullptr;
  s.scores = static_cast<float*>(dev_alloc(size_t(B) * std::max(s.nh, 1) * 4, "attention scores"));
  s.cap = int(B);
  s.window = int(B);
  s.sinks = int(B - R);
  s.snap_shift = shift;
  s.snap_done = true;
}

}  // namespace flashmoe
