// Benchmark-only entry points of the CUDA backend (cuda_bench.h): a model of
// random weights built on the device, copy and host-link bandwidths, the
// decode step's time per kernel class.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_bench.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/model_impl.cuh"
#include "core/error.h"

namespace flashmoe {

namespace cuda {
// Deterministic pseudo-random fill (synthetic weights): uniform in [-scale, scale).
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}
template <typename T>
__global__ void fill_random_kernel(T* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = float(hash32(seed * 0x9E3779B97F4A7C15ULL + i)) * (1.0f / 4294967296.0f) * 2.0f - 1.0f;
    if constexpr (std::is_same_v<T, float>) p[i] = u * scale;
    else p[i] = __float2bfloat16_rn(u * scale);
  }
}
static __global__ void fill_bytes_kernel(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = hash32(seed * 0x9E3779B97F4A7C15ULL + i);
}
// n bf16 values v at byte offset off of each of E blocks of `stride` bytes.
static __global__ void fill_bf16_parts_kernel(uint8_t* base, size_t stride, int E, size_t off, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(E) * n; i += size_t(gridDim.x) * blockDim.x)
    reinterpret_cast<__nv_bfloat16*>(base + (i / n) * stride + off)[i % n] = __float2bfloat16_rn(v);
}
// n fp32 values v at byte offset off of each of E blocks of `stride` bytes.
static __global__ void fill_f32_parts_kernel(uint8_t* base, size_t stride, int E, size_t off, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(E) * n; i += size_t(gridDim.x) * blockDim.x)
    reinterpret_cast<float*>(base + (i / n) * stride + off)[i % n] = v;
}
// Random E4M3 codes of magnitude below 2 (bit 6 of each byte clear:
// exponents 0..7, never the NaN codes), 4 per word.
static __global__ void fill_fp8_codes_kernel(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = hash32(seed * 0x9E3779B97F4A7C15ULL + i) & 0xBFBFBFBFu;
}
// Reads n 16-byte words at p (pinned host memory: zero-copy over the link),
// 8 loads in flight per thread; the xor of what a block read goes to
// out[block] so the loads are not optimised away.
static __global__ void __launch_bounds__(256) read_words_kernel(const uint4* p, size_t n, uint32_t* out) {
  constexpr int U = 8;
  uint32_t acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i0 = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i0 < n; i0 += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = i0 + u * stride;
      v[u] = i < n ? ld_stream(p + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((threadIdx.x & 31) == 0) atomicXor(out + blockIdx.x, acc);
}
static __global__ void empty_kernel() {}
static __global__ void fill_const_kernel(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}

}  // namespace cuda

std::unique_ptr<CudaModel> cuda_synthetic_model(const ModelConfig& cfg, uint64_t seed, const CudaOptions& o,
                                                const CudaSyntheticOptions& so) {
  std::unique_ptr<CudaModel> cm = CudaModelAccess::make();
  CudaModel::Impl& m = CudaModelAccess::impl(*cm);
  m.c = cfg;
  m.plan = make_plan(m.c);
  m.opts = o;
  if (o.host_cache_gb >= 0 || o.host_cache_fraction >= 0)
    fail("--gpu-host-cache: a synthetic model has no files to read experts from; give it a model (-m)");
  if (o.plan_host_slots >= 0 && o.plan_vram_slots >= 0 && o.plan_host_slots < int(cfg.num_experts) - o.plan_vram_slots)
    fail("synthetic model: the experts outside VRAM need the host to hold them all (there are no files to read "
         "them from)");
  m.init_device();
  const ModelConfig& c = m.c;
  uint64_t salt = seed;
  auto rnd = [&](int rows, int cols, const std::string& what) {
    DMat d;
    d.dt = DT_BF16;
    d.rows = rows;
    d.cols = cols;
    d.p = m.alloc(d.bytes(), what);
    fill_random_kernel<__nv_bfloat16><<<4096, 256, 0, m.stream>>>(static_cast<__nv_bfloat16*>(d.p),
                                                                   size_t(rows) * cols, ++salt,
                                                                   1.0f / std::sqrt(float(cols)));
    check(cudaGetLastError(), "fill");
    m.bytes_total += int64_t(d.bytes());
    return d;
  };
  auto cst = [&](size_t n, float v, const std::string& what) {
    float* p = m.alloc_f(n, what);
    fill_const_kernel<<<64, 256, 0, m.stream>>>(p, n, v);
    return p;
  };
  if (so.fp8_weights && so.experts != QuantKind::Fp8Block) fail("bench: FP8 weights come with FP8 experts");
  // A linear weight an FP8 release converts: DT_FP8 (128-column blocks,
  // per-row scales) with fp8_weights, else bf16.
  auto lin = [&](int rows, int cols, const std::string& what) {
    if (!so.fp8_weights) return rnd(rows, cols, what);
    if (cols % 16 != 0) fail("bench: FP8 weights need columns in multiples of 16 (" + what + ")");
    DMat d;
    d.dt = DT_FP8;
    d.rows = rows;
    d.cols = cols;
    d.group = 128;
    d.p = m.alloc(d.bytes(), what);
    fill_fp8_codes_kernel<<<4096, 256, 0, m.stream>>>(static_cast<uint32_t*>(d.p), d.scale_offset() / 4, ++salt);
    fill_const_kernel<<<64, 256, 0, m.stream>>>(const_cast<float*>(d.row_scales()), size_t(rows) * d.blocks_per_row(),
                                                0.75f / std::sqrt(float(cols)));
    check(cudaGetLastError(), "fill");
    m.bytes_total += int64_t(d.bytes());
    return d;
  };
  auto rndf = [&](size_t n, float scale, const std::string& what) {
    float* p = m.alloc_f(n, what);
    fill_random_kernel<float><<<64, 256, 0, m.stream>>>(p, n, ++salt, scale);
    return p;
  };
  const int H = int(c.hidden_size), V = int(c.vocab_size);
  const int nv = int(c.lin_num_v_heads), dv = int(c.lin_v_dim);
  const int C = int(c.lin_conv_dim()), K = int(c.conv_kernel);
  const int nh = int(c.num_heads), nkv = int(c.num_kv_heads), hd = int(c.head_dim);
  const int E = int(c.num_experts), I = int(c.moe_intermediate), Is = int(c.shared_intermediate);
  m.embed = rnd(V, H, "embedding");
  m.lm_head = c.tie_word_embeddings ? m.embed : rnd(V, H, "lm_head");
  m.final_norm = cst(size_t(H), 0.f, "norm");
  void *tmp_gu = nullptr, *tmp_dn = nullptr;
  // may_tier false: the experts in VRAM whatever the plan (the MTP head's).
  auto make_layer = [&](const LayerPlan& l, bool may_tier) {
    DLayer d;
    d.in_norm = cst(size_t(H), 0.f, "norm");
    d.post_norm = cst(size_t(H), 0.f, "norm");
    if (l.mixer == MixerKind::GatedAttention) {
      d.qkv = lin(2 * nh * hd + 2 * nkv * hd, H, "qkv");
      d.o_proj = lin(H, nh * hd, "o_proj");
      d.q_norm = cst(size_t(hd), 0.f, "q_norm");
      d.k_norm = cst(size_t(hd), 0.f, "k_norm");
    } else {
      d.lin_in = lin(C + nv * dv + 2 * nv, H, "linear in");
      d.out_proj = lin(H, nv * dv, "linear out");
      d.conv_w = rndf(size_t(C) * K, 0.5f, "conv");
      d.dt_bias = cst(size_t(nv), 0.f, "dt_bias");
      d.neg_exp_A = cst(size_t(nv), -1.f, "A");
      d.gnorm = cst(size_t(dv), 1.f, "gnorm");
    }
    if (l.ffn == FfnKind::RoutedMoE) {
      const int moe_index = l.moe_slot;
      d.router = rnd(E + (Is > 0 ? 1 : 0), H, "router");
      d.edt = DT_BF16;
      if (so.experts == QuantKind::Fp8Block) {
        if (H % 16 != 0 || I % 16 != 0)
          fail("bench: FP8 experts need the hidden size " + std::to_string(H) + " and the expert size " +
               std::to_string(I) + " in multiples of 16");
        d.q = make_fp8expert(128, 128, H, I);
      } else if (so.experts != QuantKind::None) {
        const int bits = quant_bits(so.experts), g = so.group;
        if (g <= 0 || g % 8 != 0 || H % g != 0 || I % g != 0 || H % (128 / bits) != 0 || I % (128 / bits) != 0)
          fail("bench: --group " + std::to_string(g) + " must be a multiple of 8 dividing the hidden size " +
               std::to_string(H) + " and the expert size " + std::to_string(I));
        d.q = make_qexpert(bits, g, H, I);
      }
      const size_t gu_bytes = d.q.bits ? d.q.gu_bytes : size_t(2 * I) * H * 2;
      const size_t dn_bytes = d.q.bits ? d.q.dn_bytes : size_t(H) * I * 2;
      if (may_tier && moe_index == 0 && m.make_tiers(gu_bytes, dn_bytes, m.plan.moe_layers)) {
        // Staging for one layer's experts, generated on the device and copied to pinned memory.
        tmp_gu = dev_alloc(size_t(E) * gu_bytes, "synthetic expert staging");
        tmp_dn = dev_alloc(size_t(E) * dn_bytes, "synthetic expert staging");
      }
      // E experts' gate/up and down blocks: random bf16 weights, or random
      // codes with scales and biases that spread them over the same range.
      auto fill = [&](void* gu, void* dn) {
        if (!d.q.bits) {
          fill_random_kernel<__nv_bfloat16><<<4096, 256, 0, m.stream>>>(
              static_cast<__nv_bfloat16*>(gu), size_t(E) * 2 * I * H, ++salt, 1.0f / std::sqrt(float(H)));
          fill_random_kernel<__nv_bfloat16><<<4096, 256, 0, m.stream>>>(
              static_cast<__nv_bfloat16*>(dn), size_t(E) * H * I, ++salt, 1.0f / std::sqrt(float(I)));
        } else if (d.q.fp8) {
          const QExpert& q = d.q;
          fill_fp8_codes_kernel<<<4096, 256, 0, m.stream>>>(static_cast<uint32_t*>(gu), size_t(E) * q.gu_bytes / 4, ++salt);
          fill_fp8_codes_kernel<<<4096, 256, 0, m.stream>>>(static_cast<uint32_t*>(dn), size_t(E) * q.dn_bytes / 4, ++salt);
          auto scales = [&](void* base, size_t stride, size_t s_off, int rows, int cols) {
            const size_t n = size_t((rows + 127) / 128) * ((cols + 127) / 128);
            fill_f32_parts_kernel<<<1024, 256, 0, m.stream>>>(static_cast<uint8_t*>(base), stride, E, s_off, n,
                                                              0.75f / std::sqrt(float(cols)));
          };
          scales(gu, q.gu_bytes, q.gate_s, I, H);
          scales(gu, q.gu_bytes, q.up_s, I, H);
          scales(dn, q.dn_bytes, q.dn_s, H, I);
        } else {
          const QExpert& q = d.q;
          fill_bytes_kernel<<<4096, 256, 0, m.stream>>>(static_cast<uint32_t*>(gu), size_t(E) * q.gu_bytes / 4, ++salt);
          fill_bytes_kernel<<<4096, 256, 0, m.stream>>>(static_cast<uint32_t*>(dn), size_t(E) * q.dn_bytes / 4, ++salt);
          const float top = float((1 << q.bits) - 1);
          auto affine = [&](void* base, size_t stride, size_t s_off, size_t b_off, int rows, int cols) {
            const size_t n = size_t(rows) * (cols / q.group);
            const float r = 1.0f / std::sqrt(float(cols));
            fill_bf16_parts_kernel<<<1024, 256, 0, m.stream>>>(static_cast<uint8_t*>(base), stride, E, s_off, n, 2 * r / top);
            fill_bf16_parts_kernel<<<1024, 256, 0, m.stream>>>(static_cast<uint8_t*>(base), stride, E, b_off, n, -r);
          };
          affine(gu, q.gu_bytes, q.gate_s, q.gate_b, I, H);
          affine(gu, q.gu_bytes, q.up_s, q.up_b, I, H);
          affine(dn, q.dn_bytes, q.dn_s, q.dn_b, H, I);
        }
        check(cudaGetLastError(), "fill");
      };
      if (may_tier && m.tiers) {
        // Generated in VRAM staging, then each expert moved to where it
        // lives: experts 0..slots-1 to their VRAM slots, the rest to the
        // pinned host slots (no host copy of a VRAM expert).
        fill(tmp_gu, tmp_dn);
        const int vs = m.tiers->vram_slots();
        for (int e = 0; e < vs; ++e) {
          CK(cudaMemcpyAsync(m.tiers->vram_gu(moe_index, e), static_cast<uint8_t*>(tmp_gu) + size_t(e) * gu_bytes,
                             gu_bytes, cudaMemcpyDeviceToDevice, m.stream));
          CK(cudaMemcpyAsync(m.tiers->vram_down(moe_index, e), static_cast<uint8_t*>(tmp_dn) + size_t(e) * dn_bytes,
                             dn_bytes, cudaMemcpyDeviceToDevice, m.stream));
        }
        CK(cudaMemcpyAsync(m.tiers->host_gu(moe_index), static_cast<uint8_t*>(tmp_gu) + size_t(vs) * gu_bytes,
                           size_t(E - vs) * gu_bytes, cudaMemcpyDeviceToHost, m.stream));
        CK(cudaMemcpyAsync(m.tiers->host_down(moe_index), static_cast<uint8_t*>(tmp_dn) + size_t(vs) * dn_bytes,
                           size_t(E - vs) * dn_bytes, cudaMemcpyDeviceToHost, m.stream));
        d.gu_tab = m.tiers->gu_tab(moe_index);
        d.down_tab = m.tiers->down_tab(moe_index);
        d.tc = m.tiers->count(moe_index);
      } else {
        d.gu = m.alloc(size_t(E) * gu_bytes, "experts gate/up");
        d.down = m.alloc(size_t(E) * dn_bytes, "experts down");
        m.bytes_total += int64_t(size_t(E) * (gu_bytes + dn_bytes));
        fill(d.gu, d.down);
        d.gu_tab = m.contiguous_table(d.gu, E, gu_bytes, "expert table");
        d.down_tab = m.contiguous_table(d.down, E, dn_bytes, "expert table");
      }
      if (Is > 0) {
        d.has_shared = true;
        d.s_gu = lin(2 * Is, H, "shared expert");
        d.s_down = lin(H, Is, "shared expert");
        d.edt = d.s_gu.dt;  // the shared expert's storage type (the routed experts': d.q)
      }
    } else {
      const int Id = int(c.intermediate_size);
      d.has_shared = true;
      d.s_gu = rnd(2 * Id, H, "mlp");
      d.s_down = rnd(H, Id, "mlp");
    }
    return d;
  };
  for (const LayerPlan& l : m.plan.layers) m.L.push_back(make_layer(l, true));
  if (so.mtp_head) {
    auto h = std::make_unique<DeviceMtp>();
    const LayerPlan l = make_mtp_layer_plan(c, E > 0);
    h->fc = lin(H, 2 * H, "MTP fc");
    h->norm_embedding = cst(size_t(H), 0.f, "MTP norm");
    h->norm_hidden = cst(size_t(H), 0.f, "MTP norm");
    h->final_norm = cst(size_t(H), 0.f, "MTP norm");
    h->layer = make_layer(l, false);
    h->ffn = l.ffn;
    m.alloc_mtp_buffers(*h);
    m.mtp = std::move(h);
  }
  CK(cudaStreamSynchronize(m.stream));
  cudaFree(tmp_gu);
  cudaFree(tmp_dn);
  if (m.tiers) m.tiers->start();
  m.init_common();
  return cm;
}


namespace {
// The fastest of `reps` runs of copy(r) on stream s, in milliseconds.
template <class F>
float best_ms(cudaStream_t s, int reps, F copy) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, s));
    copy(r);
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}
}  // namespace

void cuda_set_batch_graph(CudaModel& model, bool on) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  m.opts.decode.batch_graph = on;
  if (m.prefill) m.prefill->set_batch_graph(on);
}

void cuda_set_batch_experts(CudaModel& model, DecodeOptions::BatchExperts path) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  m.opts.decode.batch_experts = path;
  if (m.prefill) m.prefill->set_expert_path(int(path));
}

double cuda_copy_bandwidth_gbps(const CudaModel& model) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  CK(cudaSetDevice(m.dev));
  size_t fr = 0, tot = 0;
  CK(cudaMemGetInfo(&fr, &tot));
  size_t bytes = std::min<size_t>(size_t(2) << 30, fr / 4);
  bytes &= ~size_t(0xfffff);
  void* a = dev_alloc(bytes, "bandwidth test");
  void* b = nullptr;
  try {
    b = dev_alloc(bytes, "bandwidth test");
  } catch (...) {
    cudaFree(a);
    throw;
  }
  CK(cudaMemsetAsync(a, 1, bytes, m.stream));
  CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, m.stream));
  const float best = best_ms(m.stream, 10, [&](int r) {
    CK(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, m.stream));
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (double(best) * 1e-3) / 1e9;
}

double cuda_host_link_gbps(const CudaModel& model) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  CK(cudaSetDevice(m.dev));
  const size_t bytes = size_t(1) << 30;
  void* h = nullptr;
  CK(cudaMallocHost(&h, bytes));
  void* d = nullptr;
  try {
    d = dev_alloc(bytes, "link bandwidth test");
  } catch (...) {
    cudaFreeHost(h);
    throw;
  }
  std::memset(h, 1, bytes);
  const float best =
      best_ms(m.stream, 5, [&](int) { CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, m.stream)); });
  cudaFree(d);
  cudaFreeHost(h);
  return double(bytes) / (double(best) * 1e-3) / 1e9;
}


std::string cuda_link_rates(const CudaModel& model) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  if (!m.tiers || m.tiers->disk() || m.tiers->host_slots() < 1) return "";
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  ExpertTiers& t = *m.tiers;
  const size_t gu = t.gu_bytes(), dn = t.down_bytes();
  const int most = std::min(10, t.host_slots());
  const int sms = m.prop.multiProcessorCount;
  uint8_t* dst = static_cast<uint8_t*>(dev_alloc(size_t(most) * (gu + dn), "link rate test"));
  uint32_t* sink = static_cast<uint32_t*>(dev_alloc(size_t(sms) * 4 * 4, "link rate test"));
  cudaStream_t side;
  CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  // Layer 0's host slots 0..n-1: n experts' gate/up blocks, then their down blocks, each contiguous.
  void *hg = nullptr, *hd = nullptr;
  CK(cudaHostGetDevicePointer(&hg, t.host_gu(0), 0));
  CK(cudaHostGetDevicePointer(&hd, t.host_down(0), 0));
  auto dma = [&](int n, cudaStream_t s) {
    CK(cudaMemcpyAsync(dst, t.host_gu(0), size_t(n) * gu, cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(dst + size_t(n) * gu, t.host_down(0), size_t(n) * dn, cudaMemcpyHostToDevice, s));
  };
  auto zero_copy = [&](int n, cudaStream_t s) {
    read_words_kernel<<<sms * 4, 256, 0, s>>>(static_cast<const uint4*>(hg), size_t(n) * gu / 16, sink);
    read_words_kernel<<<sms * 4, 256, 0, s>>>(static_cast<const uint4*>(hd), size_t(n) * dn / 16, sink);
    check(cudaGetLastError(), "read_words_kernel");
  };
  auto gbps = [&](double bytes, float ms) { return bytes / (double(ms) * 1e-3) / 1e9; };
  std::string out;
  char buf[400];
  for (int n : {1, most}) {
    const double bytes = double(n) * double(gu + dn);
    const float t_dma = best_ms(m.stream, 5, [&](int) { dma(n, m.stream); });
    const float t_zc = best_ms(m.stream, 5, [&](int) { zero_copy(n, m.stream); });
    // Both at once, each its own copy of the bytes: the DMA on a side stream.
    const float t_both = best_ms(m.stream, 5, [&](int) {
      CK(cudaEventRecord(fork, m.stream));
      CK(cudaStreamWaitEvent(side, fork, 0));
      dma(n, side);
      CK(cudaEventRecord(join, side));
      zero_copy(n, m.stream);
      CK(cudaStreamWaitEvent(m.stream, join, 0));
    });
    std::snprintf(buf, sizeof buf,
                  "%s%d expert%s (%.1f MB) from pinned memory: cudaMemcpyAsync %.1f GB/s, zero-copy read kernel (%d "
                  "blocks) %.1f GB/s, both at once (twice the bytes) %.1f GB/s",
                  out.empty() ? "" : "\n  ", n, n == 1 ? "" : "s", bytes / 1e6, gbps(bytes, t_dma), sms * 4,
                  gbps(bytes, t_zc), gbps(2 * bytes, t_both));
    out += buf;
  }
  // A host round trip: a kernel launched, an event after it, the host waiting for it.
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  const int trips = 200;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < trips; ++i) {
    empty_kernel<<<1, 32, 0, m.stream>>>();
    CK(cudaEventRecord(ev, m.stream));
    CK(cudaEventSynchronize(ev));
  }
  const double us = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6 / trips;
  std::snprintf(buf, sizeof buf, "\n  host round trip (launch, event, cudaEventSynchronize): %.1f us", us);
  out += buf;
  cudaEventDestroy(ev);
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaStreamDestroy(side);
  cudaFree(dst);
  cudaFree(sink);
  return out;
}

bool cuda_set_host_copies(CudaModel& model, bool on, int n, bool next) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  m.set_host_copies(on, n, next);
  return m.host_copies;
}

std::vector<CudaKernelTime> cuda_profile_decode(const CudaModel& model, CudaState& st, int32_t first, int steps) {
  CudaModel::Impl& m = CudaModelAccess::impl(model);
  CudaState::Impl& s = *st.p_;
  CK(cudaSetDevice(m.dev));
  m.ensure_cap(s, s.pos + steps);
  std::vector<CudaKernelTime> out(K_N);
  for (int i = 0; i < K_N; ++i) out[size_t(i)].name = kClassNames[i];
  m.put_ids(s, &first, 1);
  CK(cudaMemsetAsync(s.d_step, 0, 4, m.stream));
  cudaEvent_t start;
  CK(cudaEventCreate(&start));
  m.profiling = true;
  try {
    for (int t = 0; t < steps; ++t) {
      m.event_class.clear();
      CK(cudaEventRecord(start, m.stream));
      m.enqueue_step(s, 2);
      ++s.pos;
      CK(cudaStreamSynchronize(m.stream));
      cudaEvent_t prev = start;
      for (size_t i = 0; i < m.event_class.size(); ++i) {
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, prev, m.events[i]));
        out[size_t(m.event_class[i])].ms += ms;
        out[size_t(m.event_class[i])].launches += 1;
        prev = m.events[i];
      }
    }
  } catch (...) {
    m.profiling = false;
    cudaEventDestroy(start);
    throw;
  }
  m.profiling = false;
  cudaEventDestroy(start);
  return out;
}

}  // namespace flashmoe
