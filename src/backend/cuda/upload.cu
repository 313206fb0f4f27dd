// The CUDA backend's model: the device, the weights uploaded in their
// device layouts (device_model.cuh), the tiered expert cache, the scratch
// buffers of the decode step and the routers folded into the output
// projections.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/matrix_rows.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/gguf_dense_repack.cuh"
#include "backend/cuda/model_impl.cuh"
#include "backend/cuda/fp8_router.cuh"
#include "backend/cuda/gguf_chunk_experts.cuh"
#include "backend/cuda/router.cuh"
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace flashmoe {

CudaModel::Impl::~Impl() {
  cudaSetDevice(dev);
  if (stream) cudaStreamSynchronize(stream);
  free_states.clear();
  prefill.reset();
  tiers.reset();
  for (void* p : allocs) cudaFree(p);
  for (auto e : events) cudaEventDestroy(e);
  if (pinned_logits) cudaFreeHost(pinned_logits);
  if (pinned_ids) cudaFreeHost(pinned_ids);
  if (pinned_eids) cudaFreeHost(pinned_eids);
  if (pf_stream) cudaStreamSynchronize(pf_stream);
  if (pf_pick) cudaFreeHost(pf_pick);
  if (pf_seq_host) cudaFreeHost(pf_seq_host);
  if (pf_rest) cudaFreeHost(pf_rest);
  for (auto e : {pf_picked, pf_copied, pf_staged})
    if (e) cudaEventDestroy(e);
  if (pf_stream) cudaStreamDestroy(pf_stream);
  if (state_stream) cudaStreamDestroy(state_stream);
  if (stream) cudaStreamDestroy(stream);
}

void* CudaModel::Impl::alloc(size_t bytes, const std::string& what) {
  void* p = dev_alloc(bytes, what);
  allocs.push_back(p);
  return p;
}

float* CudaModel::Impl::upload_vec(const std::vector<float>& v, const std::string& what) {
  float* p = alloc_f(v.size(), what);
  CK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return p;
}

// Rows of several host matrices (same cols) written one after the other
// into dst (host memory) in storage type dt; returns the bytes written.
size_t CudaModel::Impl::write_rows_host(const std::vector<Matrix>& parts, int dt, uint8_t* dst) {
  size_t off = 0;
  std::vector<float> row;
  for (const Matrix& p : parts) {
    const size_t n = size_t(p.rows) * p.cols, out_bytes = n * dt_size(dt);
    if (p.quantized()) {  // dequantised as the CPU does, then stored as dt
      row.resize(size_t(p.cols));
      for (int64_t r = 0; r < p.rows; ++r) {
        cpu::quant_dequant_row(p, r, row.data());
        const size_t o = size_t(r) * p.cols;
        for (int64_t i = 0; i < p.cols; ++i) {
          if (dt == DT_F32) reinterpret_cast<float*>(dst + off)[o + i] = row[size_t(i)];
          else if (dt == DT_F16) reinterpret_cast<uint16_t*>(dst + off)[o + i] = f32_to_f16(row[size_t(i)]);
          else reinterpret_cast<uint16_t*>(dst + off)[o + i] = f32_to_bf16(row[size_t(i)]);
        }
      }
    } else if (dt_of(p.dtype) == dt) {
      std::memcpy(dst + off, p.data, out_bytes);
    } else {
      for (size_t i = 0; i < n; ++i) {  // widen (or narrow, when forced)
        float f;
        switch (p.dtype) {
          case DType::F32: f = static_cast<const float*>(p.data)[i]; break;
          case DType::F16: f = f16_to_f32(static_cast<const uint16_t*>(p.data)[i]); break;
          default: f = bf16_to_f32(static_cast<const uint16_t*>(p.data)[i]); break;
        }
        if (dt == DT_F32) reinterpret_cast<float*>(dst + off)[i] = f;
        else if (dt == DT_F16) reinterpret_cast<uint16_t*>(dst + off)[i] = f32_to_f16(f);
        else reinterpret_cast<uint16_t*>(dst + off)[i] = f32_to_bf16(f);
      }
    }
    off += out_bytes;
  }
  return off;
}

// Rows of several host matrices (same cols) stacked into one device matrix,
// in the common storage type (f32 when they differ or when forced).
DMat CudaModel::Impl::upload_rows(const std::vector<Matrix>& parts, const std::string& what, int force_dt, bool fp8,
                                  bool dense) {
  if (fp8 && force_dt < 0 && std::all_of(parts.begin(), parts.end(), [&](const Matrix& x) {
        return x.fp8() && x.group == parts[0].group && x.group % 16 == 0 && x.cols % 16 == 0;
      }))
    return upload_fp8_rows(parts, what);
  DMat m;
  m.cols = int(parts.at(0).cols);
  int dt = force_dt >= 0 ? force_dt : storage_dt(parts[0]);
  int64_t rows = 0;
  for (const Matrix& p : parts) {
    if (p.cols != m.cols) fail("CUDA backend: " + what + ": parts differ in columns");
    if ((force_dt < 0 || dt == DT_GGUF) && storage_dt(p) != dt) dt = DT_F32;
    rows += p.rows;
  }
  // GGUF blocks as stored; mixed with float parts (or more parts than a
  // GMat holds), all dequantised to f32 like the MLX q8/q4 projections.
  if (dt == DT_GGUF && parts.size() <= size_t(kGParts)) return upload_blocks(parts, what, dense);
  if (dt == DT_GGUF) dt = DT_F32;
  m.dt = dt;
  m.rows = int(rows);
  if ((size_t(m.cols) * dt_size(dt)) % 16 != 0)
    fail_device(DeviceFailure::Unsupported, "CUDA backend: " + what + " has " + std::to_string(m.cols) +
                                                " columns; rows must be a multiple of 16 bytes");
  m.p = alloc(m.bytes(), what);
  uint8_t* dst = static_cast<uint8_t*>(m.p);
  std::vector<uint8_t> buf;
  for (const Matrix& p : parts) {  // one part at a time: bounded host memory
    buf.resize(size_t(p.rows) * p.cols * dt_size(dt));
    const size_t n = write_rows_host({p}, dt, buf.data());
    CK(cudaMemcpy(dst, buf.data(), n, cudaMemcpyHostToDevice));
    dst += n;
  }
  bytes_total += int64_t(m.bytes());
  return m;
}

DMat CudaModel::Impl::upload_blocks(const std::vector<Matrix>& parts, const std::string& what, bool dense) {
  DMat m;
  m.dt = DT_GGUF;
  m.cols = int(parts.at(0).cols);
  // Dense matrices of the decode step repacked for gdense_matvec_kernel
  // (gguf_dense_layout.cuh) where every part's kind has a repacked form.
  const bool repack = dense && opts.decode.gguf_dense_repack &&
                      std::all_of(parts.begin(), parts.end(),
                                  [&](const Matrix& p) { return gdense_repackable(int(p.quant), m.cols); });
  size_t off = 0;
  m.g = gmat_stack(parts, repack, off);
  m.rows = m.g.row0[m.g.n];
  m.gbytes = off;
  m.p = alloc(off, what);
  std::unique_ptr<ThreadPool> pool;
  if (repack) pool = std::make_unique<ThreadPool>(0);
  for (int i = 0; i < m.g.n; ++i) {
    const Matrix& p = parts[size_t(i)];
    uint8_t* dst = static_cast<uint8_t*>(m.p) + m.g.off[i];
    if (!repack) {
      CK(cudaMemcpy(dst, p.data, p.nbytes(), cudaMemcpyHostToDevice));
      continue;
    }
    // Repacked a chunk of rows at a time (bounded host memory), rows over the pool's threads.
    const int chunk = 4096;
    const size_t src_rb = gguf_row_bytes(m.g.kind[i] - kGDense, m.cols), rb = gguf_row_bytes(m.g.kind[i], m.cols);
    std::vector<uint8_t> buf(size_t(std::min<int64_t>(chunk, p.rows)) * rb);
    for (int64_t r0 = 0; r0 < p.rows; r0 += chunk) {
      const int n = int(std::min<int64_t>(chunk, p.rows - r0));
      const uint8_t* src = static_cast<const uint8_t*>(p.data) + size_t(r0) * src_rb;
      pool->parallel_for(n, [&](int64_t a, int64_t b) {
        gdense_repack_rows(m.g.kind[i] - kGDense, src + size_t(a) * src_rb, int(b - a), m.cols, buf.data() + size_t(a) * rb);
      }, 64);
      CK(cudaMemcpy(dst + size_t(r0) * rb, buf.data(), size_t(n) * rb, cudaMemcpyHostToDevice));
    }
  }
  bytes_total += int64_t(off);
  return m;
}

void CudaModel::Impl::gguf_expert_layout(const FfnExpert& e, DLayer& d, size_t& gu_bytes, size_t& dn_bytes) const {
  auto up16 = [](size_t x) { return (x + 15) / 16 * 16; };
  const int I = int(c.moe_intermediate);
  d.gg = GMat{};
  d.gg.n = 2;
  d.gg.row0[0] = 0, d.gg.row0[1] = I, d.gg.row0[2] = 2 * I;
  d.gg.kind[0] = int(e.gate.quant), d.gg.kind[1] = int(e.up.quant);
  d.gg.off[0] = 0, d.gg.off[1] = up16(e.gate.nbytes());
  gu_bytes = up16(d.gg.off[1] + e.up.nbytes());
  d.gd = GMat{};
  d.gd.n = 1;
  d.gd.row0[1] = int(c.hidden_size);
  d.gd.kind[0] = int(e.down.quant);
  dn_bytes = up16(e.down.nbytes());
}

void CudaModel::Impl::write_gguf_expert(const FfnExpert& e, int part, const GMat& gg, const GMat& gd,
                                        const std::string& where, uint8_t* dst) {
  auto put = [&](const Matrix& m, int kind, size_t off) {
    if (int(m.quant) != kind)
      fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where + "experts differ in GGUF block type");
    std::memcpy(dst + off, m.data, m.nbytes());
  };
  if (part == 0) {
    put(e.gate, gg.kind[0], gg.off[0]);
    put(e.up, gg.kind[1], gg.off[1]);
  } else {
    put(e.down, gd.kind[0], 0);
  }
}

// FP8 block matrices (same cols and block width) stacked as one DT_FP8
// matrix: the codes as stored, each row's block scales written out per row.
DMat CudaModel::Impl::upload_fp8_rows(const std::vector<Matrix>& parts, const std::string& what) {
  DMat m;
  m.dt = DT_FP8;
  m.cols = int(parts.at(0).cols);
  m.group = parts[0].group;
  int64_t rows = 0;
  for (const Matrix& p : parts) rows += p.rows;
  m.rows = int(rows);
  m.p = alloc(m.bytes(), what);
  const int nbc = m.blocks_per_row();
  std::vector<float> scales(size_t(rows) * nbc);
  uint8_t* dst = static_cast<uint8_t*>(m.p);
  int64_t r0 = 0;
  for (const Matrix& p : parts) {
    CK(cudaMemcpy(dst, p.data, p.nbytes(), cudaMemcpyHostToDevice));
    dst += p.nbytes();
    for (int64_t r = 0; r < p.rows; ++r)
      for (int b = 0; b < nbc; ++b) scales[size_t(r0 + r) * nbc + b] = p.block_scale(r, b);
    r0 += p.rows;
  }
  CK(cudaMemcpy(static_cast<uint8_t*>(m.p) + m.scale_offset(), scales.data(), scales.size() * 4,
                cudaMemcpyHostToDevice));
  bytes_total += int64_t(m.bytes());
  return m;
}

// The device layout of a layer's quantised experts (all like `e`), or an
// Error naming the layer where the kernels cannot take them.
QExpert CudaModel::Impl::quant_layout(const FfnExpert& e, const std::string& where) const {
  const Matrix& g = e.gate;
  if (g.fp8()) {  // fp8_experts.cuh: 16 codes per load, within one scale block
    const int H = int(c.hidden_size), I = int(c.moe_intermediate);
    if (H % 16 != 0 || I % 16 != 0 || g.group % 16 != 0 || g.block_rows <= 0)
      fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where + "FP8 experts with hidden size " +
                                                  std::to_string(H) + ", expert size " + std::to_string(I) +
                                                  " and blocks of " + std::to_string(g.block_rows) + " x " +
                                                  std::to_string(g.group) + " (need multiples of 16)");
    return make_fp8expert(g.group, g.block_rows, H, I);
  }
  const int bits = quant_bits(g.quant), H = int(c.hidden_size), I = int(c.moe_intermediate);
  const int epc = 128 / bits;  // columns per 16-byte load (quant_experts.cuh)
  if (H % epc != 0 || I % epc != 0 || g.group % 8 != 0)
    fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where + "experts in " + quant_name(g.quant) +
                                                " with hidden size " + std::to_string(H) + " and expert size " +
                                                std::to_string(I) + " (need multiples of " + std::to_string(epc) +
                                                ", groups of a multiple of 8)");
  return make_qexpert(bits, g.group, H, I);
}

// Expert e's gate/up block (part 0) or down block (1) in the layout q, at dst.
void CudaModel::Impl::write_quant(const FfnExpert& e, int part, const QExpert& q, const std::string& where, uint8_t* dst) {
  auto put = [&](const Matrix& m, size_t w, size_t sc, size_t bi) {
    if (q.fp8) {  // codes and block scales as stored
      if (!m.fp8() || m.group != q.group || m.block_rows != q.block_rows)
        fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where + "experts differ in FP8 blocks");
      if (m.block_row0 != 0)  // a slice of a fused gate/up tensor whose halves share a block row
        fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where +
                                                    "FP8 expert rows start inside a scale block (fused gate/up with an "
                                                    "expert size not a multiple of the block rows); run with --device cpu");
      std::memcpy(dst + w, m.data, m.nbytes());
      std::memcpy(dst + sc, m.block_scales, m.block_scale_bytes());
      return;
    }
    if (quant_bits(m.quant) != q.bits || m.group != q.group || m.fp8())
      fail_device(DeviceFailure::Unsupported, "CUDA backend: " + where + "experts differ in quantisation");
    std::memcpy(dst + w, m.data, m.nbytes());
    std::memcpy(dst + sc, m.scales, m.scale_bytes());
    std::memcpy(dst + bi, m.biases, m.scale_bytes());
  };
  if (part == 0) {
    put(e.gate, 0, q.gate_s, q.gate_b);
    put(e.up, q.up_w, q.up_s, q.up_b);
  } else {
    put(e.down, 0, q.dn_s, q.dn_b);
  }
}

// Expert pointer table of a layer whose experts are contiguous in VRAM.
const void* const* CudaModel::Impl::contiguous_table(const void* base, int E, size_t stride, const std::string& what) {
  std::vector<const void*> t(static_cast<size_t>(E), nullptr);
  for (int e = 0; e < E; ++e) t[size_t(e)] = static_cast<const uint8_t*>(base) + size_t(e) * stride;
  void* d = alloc(t.size() * sizeof(void*), what);
  CK(cudaMemcpy(d, t.data(), t.size() * sizeof(void*), cudaMemcpyHostToDevice));
  return static_cast<const void* const*>(d);
}

// Slots per MoE layer for the routed experts in a budget of gb (or a
// fraction of all expert bytes); E (all) when neither is given.
int CudaModel::Impl::expert_slots(int64_t expert_bytes, int64_t moe, double gb, double fraction) const {
  const int64_t E = c.num_experts;
  if (E <= 0 || moe == 0) return int(E);
  double budget;
  if (gb >= 0) budget = gb * 1e9;
  else if (fraction >= 0) budget = fraction * double(E * moe * expert_bytes);
  else return int(E);
  const int64_t slots = int64_t(budget / double(moe * expert_bytes));
  return int(std::clamp<int64_t>(slots, 0, E));
}

// Creates the tiered cache when the routed experts (gu + dn bytes each) do
// not all get VRAM.
bool CudaModel::Impl::make_tiers(size_t gu, size_t dn, int moe) {
  const int64_t E = c.num_experts;
  // A memory plan (runtime/memory_plan.h) gives the slots; else the sizes.
  const bool planned = opts.plan_vram_slots >= 0;
  const int slots = planned ? int(std::min<int64_t>(opts.plan_vram_slots, E))
                            : expert_slots(int64_t(gu + dn), moe, opts.expert_cache_gb, opts.expert_cache_fraction);
  if (slots >= E) return false;
  const int host = planned ? (opts.plan_host_slots >= 0 ? opts.plan_host_slots : int(E) - slots)
                           : expert_slots(int64_t(gu + dn), moe, opts.host_cache_gb, opts.host_cache_fraction);
  // The host holds the experts outside VRAM when it has room for them all;
  // with less, its slots cache experts read from the model's files.
  const bool on_disk = host < int(E) - slots;
  if (on_disk && host < int(c.num_experts_per_tok))
    fail("--gpu-host-cache: " + std::to_string(host) + " experts per layer in host memory, fewer than the " +
         std::to_string(c.num_experts_per_tok) + " one token uses; give it more");
  tiers = std::make_unique<ExpertTiers>(moe, int(E), gu, dn, slots, host, on_disk);
  bytes_total += int64_t(tiers->vram_bytes());
  if (tiers->disk()) {
    // Experts come from disk between the router and the expert kernels: the
    // step waits for the host there, so no graph, no pick inside gate_up or
    // the output projection, no row pointers resolved before the tables are
    // final. Prompts go in chunks whose choices fit the host slots.
    disk = true;
    use_graph = false;
    opts.decode.pick_in_kernels = false;
  }
  return true;
}

void CudaModel::Impl::init_device() {
  std::string why;
  if (!CudaModel::available(&why)) fail_device(DeviceFailure::Unavailable, "no usable CUDA device: " + why);
  chunk = std::clamp(opts.decode.prefill_chunk, 1, kRing - 1);
  dev = opts.device;
  CK(cudaSetDevice(dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&state_stream, cudaStreamNonBlocking));
  set_kernel_attributes();
}

// Scratch buffers and constants, once the dimensions are known.
void CudaModel::Impl::init_common() {
  const ModelConfig& m = c;
  if (m.num_experts > 512) fail_device(DeviceFailure::Unsupported, "CUDA backend: more than 512 experts is not supported");
  if (m.num_experts_per_tok > 32) fail_device(DeviceFailure::Unsupported, "CUDA backend: top-k above 32 is not supported");
  if (m.num_kv_heads > 0 && (m.num_heads % m.num_kv_heads) != 0) fail_device(DeviceFailure::Unsupported, "CUDA backend: heads not a multiple of kv heads");
  std::vector<float> inv = plan.rope_inv_freq;
  if (inv.empty()) inv.push_back(0.f);  // no rotary dims: a valid pointer all the same
  inv_freq = upload_vec(inv, "rotary frequencies");
  ones = upload_vec({1.0f, 1.0f}, "constants");
  int proj_rows = 1;
  for (const DLayer& l : L) proj_rows = std::max({proj_rows, l.lin_in.rows, l.qkv.rows});
  const int64_t H = m.hidden_size;
  x = alloc_f(size_t(H), "activations");
  proj = alloc_f(size_t(proj_rows), "activations");
  convout = alloc_f(size_t(std::max<int64_t>(1, m.lin_conv_dim())), "activations");
  const int64_t O = std::max<int64_t>({1, m.lin_num_v_heads * m.lin_v_dim, m.num_heads * m.head_dim});
  cat = alloc_f(size_t(H + O), "activations");
  lin_o = cat + H;  // a layer is linear or full: the two never live at once
  q = alloc_f(size_t(std::max<int64_t>(1, m.num_heads * m.head_dim)), "activations");
  attn_o = cat + H;
  if (opts.decode.pick_in_kernels) fold_routers();
  rlogits = alloc_f(size_t(m.num_experts + 1), "router logits");
  ew = alloc_f(size_t(m.num_experts_per_tok + 1), "expert weights");
  eids = static_cast<int*>(alloc(size_t(m.num_experts_per_tok + 1) * 4, "expert ids"));
  maxI = int(std::max({m.moe_intermediate, m.shared_intermediate, m.intermediate_size, int64_t(1)}));
  hb = alloc_f(size_t(m.num_experts_per_tok + 1) * maxI, "expert activations");
  logits = alloc_f(size_t(m.vocab_size), "logits");
  sel = static_cast<const void**>(alloc(size_t(2 * std::max<int64_t>(1, m.num_experts_per_tok)) * sizeof(void*),
                                        "expert selection"));
  presel_done = static_cast<unsigned*>(alloc(4, "router counter"));
  presel_w = alloc_f(size_t(m.num_experts_per_tok + 1), "expert weights");
  CK(cudaMemset(presel_done, 0, 4));
  CK(cudaMemset(eids, 0, size_t(m.num_experts_per_tok + 1) * 4));
  CK(cudaMemset(ew, 0, size_t(m.num_experts_per_tok + 1) * 4));
  CK(cudaMallocHost(&pinned_logits, size_t(m.vocab_size) * 4));
  CK(cudaMallocHost(&pinned_ids, size_t(kRing) * 4));
  // Disk tier: one token's choices, or a prefill chunk's (at most as many as host slots, so at most E).
  CK(cudaMallocHost(&pinned_eids, size_t(std::max<int64_t>(1, std::max(m.num_experts_per_tok, m.num_experts))) * 4));
  // Bytes one decoded token reads: everything but the unrouted experts.
  bytes_per_token = int64_t(lm_head.bytes()) + int64_t(embed.row_bytes());
  for (const LayerPlan& lp : plan.layers) {
    const DLayer& l = L[size_t(lp.index)];
    // The checkpoint's bytes (the roofline's numerator): a folded router
    // reads its fp32 fold instead, more bytes, not counted here.
    bytes_per_token += int64_t(l.lin_in.bytes() + l.out_proj.bytes() + l.qkv.bytes() + l.o_proj.bytes() +
                               l.router.bytes() + l.s_gu.bytes() + l.s_down.bytes());
    if (lp.ffn == FfnKind::RoutedMoE)
      bytes_per_token += int64_t(m.num_experts_per_tok) *
                         (l.gg.n ? int64_t(m.moe_intermediate) * int64_t(gguf_row_bytes(l.gg.kind[0], int(H)) +
                                                                          gguf_row_bytes(l.gg.kind[1], int(H))) +
                                       H * int64_t(gguf_row_bytes(l.gd.kind[0], int(m.moe_intermediate)))
                          : l.q.bits ? int64_t(l.q.gu_bytes + l.q.dn_bytes)
                                     : 3 * m.moe_intermediate * m.hidden_size * int64_t(dt_size(l.edt)));
  }
  // The rule (bench/NOTES-cuda.md, "Every host-tier expert by the copy
  // engine"): a host tier of q4/q8 experts (no disk tier) holding at least
  // 40% of each layer's experts reaches the expert kernels by the copy
  // engine, two experts per MoE layer copied ahead (60 layers of the 397B:
  // 82% of the link bound against 77% with one and 72% without the copies;
  // 20 layers: 77% / 74% / 71%): measured to win with 47% of them there.
  // Below that it is not measured, and the plain launches it
  // needs cost ~5% on a model read mostly from VRAM (the 35B: 248 against
  // 261 tokens/s), so the zero-copy kernels and the graph stay.
  // (Session 8 found a decode after a prompt hanging on the 397B with this
  // path on: CUDA's lazy module loading; release_copies() in decode_step.cu.)
  // Copies ahead: two where a token chooses 3 or more host-tier experts per
  // layer on average (K = 10 on the 397B: 4.6; 82% of the link bound against
  // 77% with one), else one (--moe-top-k 4: 1.9; 43.7 against 41.3 tokens/s
  // with two, whose second copy was read only ~60% of the time:
  // bench/results/session9-h200-397b.txt).
  const bool copies = tiers && tiers->host_slots() * 5 >= int(c.num_experts) * 2;
  const int ahead = copies && int64_t(c.num_experts_per_tok) * tiers->host_slots() >= 3 * c.num_experts ? 2 : 1;
  set_host_copies(copies, ahead, true);
}

void CudaModel::Impl::set_host_copies(bool on, int n, bool next) {
  n = std::clamp(n, 0, kPrefetchMax / 2);
  if (pf_stream) CK(cudaStreamSynchronize(pf_stream));
  pf_outstanding = false;
  rest_seq = 0;
  // No host tier to copy from (the disk tier reads its experts between the
  // router and the kernels), or more routed slots than staging slots.
  if (!tiers || disk || c.num_experts_per_tok > kRestMax) on = false;
  if (on && !pf_stage) {
    for (const LayerPlan& lp : plan.layers) {
      const DLayer& d = L[size_t(lp.index)];
      if (lp.ffn == FfnKind::RoutedMoE && d.q.bits && !d.q.fp8 && !d.gg.n) {
        pf_gu = d.q.gu_bytes;
        pf_dn = d.q.dn_bytes;
        break;
      }
    }
    if (pf_gu == 0) {
      host_copies = false;  // no q4/q8 experts: the copies do not apply
      return;
    }
    const int k = int(c.num_experts_per_tok);
    pf_stage = static_cast<uint8_t*>(alloc(size_t(kPrefetchMax + k) * (pf_gu + pf_dn), "experts copied ahead"));
    pf_src = static_cast<const void**>(alloc(2 * kPrefetchMax * sizeof(void*), "experts copied ahead"));
    pf_logits = alloc_f(size_t(c.num_experts), "predicted router logits");
    pf_done = static_cast<unsigned*>(alloc(4, "prediction counter"));
    pf_used = static_cast<unsigned long long*>(alloc(8, "prediction counter"));
    pf_flag = static_cast<unsigned*>(alloc(kStageSlots * 4, "prefetch flags"));
    pf_slot = static_cast<int*>(alloc(size_t(std::max(1, k)) * 4, "prefetch slots"));
    CK(cudaMemset(pf_flag, 0, kStageSlots * 4));
    CK(cudaMallocHost(&pf_seq_host, kSeqRing * sizeof(unsigned)));
    CK(cudaMemset(pf_done, 0, 4));
    CK(cudaMemset(pf_used, 0, 8));
    auto mapped = [](size_t bytes, void** dev) {
      void* h = nullptr;
      CK(cudaHostAlloc(&h, bytes, cudaHostAllocMapped));
      std::memset(h, 0, bytes);
      CK(cudaHostGetDevicePointer(dev, h, 0));
      return h;
    };
    void* dp = nullptr;
    pf_pick = static_cast<PrefetchPick*>(mapped(sizeof(PrefetchPick), &dp));
    pf_pick_dev = static_cast<PrefetchPick*>(dp);
    pf_rest = static_cast<PrefetchRest*>(mapped(sizeof(PrefetchRest), &dp));
    pf_rest_dev = static_cast<PrefetchRest*>(dp);
    CK(cudaStreamCreateWithFlags(&pf_stream, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&pf_picked, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&pf_copied, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&pf_staged, cudaEventDisableTiming));
    // The flags by a stream memory operation (no copy engine time), where the driver has it.
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      write_value32 = fn;
    cudaGetLastError();
  }
  host_copies = on;
  prefetch_n = n;
  prefetch_next = next;
  pf_next_n = 0;
}

// Folds each MoE layer's router into its output projection's launch where
// the shapes allow (see outproj_router_kernel); other layers keep the router.
template <typename T>
void CudaModel::Impl::fold_router(DLayer& d, const DMat& out) {
  const int H = int(c.hidden_size), O = out.cols, rows = d.router.rows;
  d.rfold = static_cast<float*>(alloc(size_t(rows) * (H + O) * 4, "folded router"));
  bytes_total += int64_t(rows) * (H + O) * 4;
  const dim3 grid(std::max(1, std::min(64, (H + O + 255) / 256)), rows);
  if (out.dt == DT_FP8) {  // the projection's codes times its block scales (fp8_router.cuh)
    fold_router_fp8_kernel<T><<<grid, 256, 0, stream>>>(static_cast<const T*>(d.router.p), rows, d.post_norm,
                                                       static_cast<const uint8_t*>(out.p), out.row_scales(),
                                                       out.group, H, O, d.rfold);
    check(cudaGetLastError(), "fold_router_fp8_kernel");
    return;
  }
  fold_router_kernel<T><<<grid, 256, 0, stream>>>(static_cast<const T*>(d.router.p), rows, d.post_norm,
                                                 static_cast<const T*>(out.p), H, O, d.rfold);
  check(cudaGetLastError(), "fold_router_kernel");
}

void CudaModel::Impl::fold_routers() {
  const int H = int(c.hidden_size);
  for (const LayerPlan& l : plan.layers) {
    DLayer& d = L[size_t(l.index)];
    const DMat& out = l.mixer == MixerKind::GatedAttention ? d.o_proj : d.out_proj;
    // Quantised experts' gate_up cannot pick (quant_experts.cuh); with the
    // fold the pick is the output projection's (outproj_router_kernel).
    if (l.ffn != FfnKind::RoutedMoE || !d.router.p || !d.post_norm || !out.p || out.rows != H || d.router.cols != H ||
        H % 4 != 0 || out.cols % 4 != 0)
      continue;
    // A float projection folds with a router of its type; an FP8 one (on
    // the tensor cores: blocks a multiple of 64 wide) with a float router.
    if (out.dt == DT_FP8 ? out.group % kF8Step != 0 || !(d.router.dt == DT_F32 || d.router.dt == DT_F16 ||
                                                         d.router.dt == DT_BF16)
                         : out.dt != d.router.dt)
      continue;
    switch (d.router.dt) {
      case DT_F32: fold_router<float>(d, out); break;
      case DT_F16: fold_router<__half>(d, out); break;
      default: fold_router<__nv_bfloat16>(d, out);
    }
  }
  CK(cudaStreamSynchronize(stream));
}

bool CudaModel::memory_info(int64_t* free_bytes, int64_t* total_bytes) {
  if (!available()) return false;
  size_t fr = 0, tot = 0;
  if (cudaSetDevice(0) != cudaSuccess || cudaMemGetInfo(&fr, &tot) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  *free_bytes = int64_t(fr);
  *total_bytes = int64_t(tot);
  return true;
}

bool CudaModel::available(std::string* why, bool* too_old) {
  if (too_old) *too_old = false;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = cuda_msg(e);
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  // The kernels are built for sm_90 and use Hopper instructions (programmatic
  // dependent launch): an older GPU would fail at the first launch.
  cudaDeviceProp p{};
  e = cudaGetDeviceProperties(&p, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = cuda_msg(e);
    return false;
  }
  if (p.major < 9) {
    if (too_old) *too_old = true;
    if (why)
      *why = std::string("GPU 0 (") + p.name + ") has compute capability " + std::to_string(p.major) + "." +
             std::to_string(p.minor) + "; this build's CUDA kernels need 9.0 (Hopper) or newer";
    return false;
  }
  return true;
}

CudaModel::CudaModel() : p_(new Impl) {}
CudaModel::~CudaModel() = default;

const ModelConfig& CudaModel::config() const { return p_->c; }
std::string CudaModel::device_name() const { return p_->prop.name; }
int64_t CudaModel::weight_bytes_total() const { return p_->bytes_total; }
int64_t CudaModel::weight_bytes_per_token() const { return p_->bytes_per_token; }
void CudaModel::set_use_graph(bool on) { p_->use_graph = on && !p_->disk; }  // the disk tier waits for the host inside a step

// One decoder layer's weights to the device (layer plan l, weights lw, its
// routed experts through `store` under layer i): the main layers in order,
// and the MTP head's layer (may_tier false: its experts all in VRAM).
// tiered, tier_gu, tier_dn: the tiered cache's decision and expert sizes,
// made at the first MoE layer.
DLayer upload_layer(CudaModel::Impl& m, const LayerPlan& l, const LayerWeights& lw, ExpertStore& store, int64_t i,
                    const std::string& p, bool may_tier, bool& tiered, size_t& tier_gu, size_t& tier_dn) {
  const ModelConfig& c = m.c;
  const bool attention = l.mixer == MixerKind::GatedAttention, moe = l.ffn == FfnKind::RoutedMoE;
  if (attention != (lw.kind == LayerKind::Full) || moe != lw.ffn.moe)
    fail("CUDA backend: " + p + "weights do not match the layer plan of the config");
  DLayer d;
  d.in_norm = m.upload_vec(lw.input_norm, p + "norm");
  d.post_norm = m.upload_vec(lw.post_norm, p + "norm");
  if (attention) {
    const AttentionWeights& a = lw.attn;
    d.qkv = m.upload_rows({a.q_proj, a.k_proj, a.v_proj}, p + "q/k/v projection", -1, true, true);
    d.o_proj = m.upload_rows({a.o_proj}, p + "o_proj", -1, true, true);
    d.q_norm = m.upload_vec(a.q_norm, p + "q_norm");
    d.k_norm = m.upload_vec(a.k_norm, p + "k_norm");
  } else {
    const LinearAttentionWeights& l = lw.lin;
    d.lin_in = m.upload_rows(l.in_proj.block_views(), p + "linear-attention projections", -1, true, true);
    d.out_proj = m.upload_rows({l.out_proj}, p + "out_proj", -1, true, true);
    d.conv_w = m.upload_vec(l.conv, p + "conv1d");
    d.dt_bias = m.upload_vec(l.dt_bias, p + "dt_bias");
    d.neg_exp_A = m.upload_vec(l.neg_exp_A, p + "A_log");
    d.gnorm = m.upload_vec(l.norm, p + "gated norm");
    d.v_tiled = l.v_heads_tiled;
  }
  const FfnWeights& f = lw.ffn;
  if (moe) {
    const int moe_index = l.moe_slot;
    std::vector<Matrix> r = {f.router};
    if (f.has_shared) r.push_back(f.shared_gate);
    d.router = m.upload_rows(r, p + "router");
    // The routed experts come through the model's expert store: views of
    // the checkpoint, or of packed files (mmapped or streamed from disk,
    // read once here). A packed model's experts share one format; a
    // checkpoint's float experts take one storage type for the layer.
    const int E = int(c.num_experts), H = int(c.hidden_size), I = int(c.moe_intermediate);
    const ExpertBatch first_batch = store.fetch(i, {0});
    const FfnExpert& first = first_batch.experts.at(0);
    const bool gguf = first.gate.block_quantized();
    int dt = first.gate.quantized() ? DT_BF16 : dt_of(first.gate.dtype);
    auto same = [&](const Matrix& x) {
      if (!x.quantized() && dt_of(x.dtype) != dt) dt = DT_F32;
    };
    for (const FfnExpert& e : f.experts) same(e.gate), same(e.up), same(e.down);
    if (f.has_shared) {
      if (first.gate.quantized()) dt = storage_dt(f.shared.gate);
      same(f.shared.gate), same(f.shared.up), same(f.shared.down);
    }
    d.edt = dt;
    size_t gu_bytes, dn_bytes;
    if (gguf) {
      m.gguf_expert_layout(first, d, gu_bytes, dn_bytes);
    } else {
      if (first.gate.quantized()) d.q = m.quant_layout(first, p);
      gu_bytes = d.q.bits ? d.q.gu_bytes : size_t(2 * I) * H * dt_size(dt);
      dn_bytes = d.q.bits ? d.q.dn_bytes : size_t(H) * I * dt_size(dt);
    }
    if (moe_index == 0 && may_tier) tiered = m.make_tiers(gu_bytes, dn_bytes, m.plan.moe_layers);
    if (tiered && moe_index > 0 && (gu_bytes != tier_gu || dn_bytes != tier_dn))
      fail_device(DeviceFailure::Unsupported, "--gpu-expert-cache: the experts of " + p +
                                                  "have a different storage format than those of the first MoE layer");
    // GGUF experts all in VRAM, no VRAM budget asked for them: the chunk
    // layout of the decode step's expert kernels (gguf_chunks.cuh; Q4_K 192
    // bytes per 256 weights against the file's 144, Q6_K 256 against 210).
    // The memory plan counted the file's sizes, so the first MoE layer
    // decides for all: where the free VRAM holds every layer's experts in
    // the chunk layout (this one's, +10% for layers of more bits) and 8 GB
    // besides. Staged on the host as stored (sg, sd; s_gu, s_dn bytes an
    // expert), rearranged on the device.
    const GMat sg = d.gg, sd = d.gd;
    const size_t s_gu = gu_bytes, s_dn = dn_bytes;
    GMat cg, cd;
    size_t cgu = 0, cdn = 0;
    const bool chunkable = gguf && !tiered && gc_expert_layout(sg, sd, H, I, cg, cd, cgu, cdn);
    if (moe_index == 0 && may_tier) {
      size_t free_b = 0, total_b = 0;
      m.gguf_chunks = chunkable && m.opts.decode.gguf_expert_chunks && m.opts.expert_cache_gb < 0 &&
                      m.opts.expert_cache_fraction < 0 && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess &&
                      double(E) * m.plan.moe_layers * double(cgu + cdn) * 1.1 + 8e9 <= double(free_b);
    }
    const bool chunks = m.gguf_chunks && chunkable;
    if (chunks) d.gg = cg, d.gd = cd, gu_bytes = cgu, dn_bytes = cdn;
    GcScratch scratch;
    uint8_t *gu_dst, *dn_dst;
    if (tiered) {
      gu_dst = m.tiers->host_gu(moe_index);
      dn_dst = m.tiers->host_down(moe_index);
      d.gu_tab = m.tiers->gu_tab(moe_index);
      d.down_tab = m.tiers->down_tab(moe_index);
      d.tc = m.tiers->count(moe_index);
    } else {
      d.gu = m.alloc(size_t(E) * gu_bytes, p + "experts gate/up");
      d.down = m.alloc(size_t(E) * dn_bytes, p + "experts down");
      m.bytes_total += int64_t(size_t(E) * (gu_bytes + dn_bytes));
      gu_dst = static_cast<uint8_t*>(d.gu);
      dn_dst = static_cast<uint8_t*>(d.down);
      d.gu_tab = m.contiguous_table(d.gu, E, gu_bytes, p + "expert table");
      d.down_tab = m.contiguous_table(d.down, E, dn_bytes, p + "expert table");
    }
    // Disk tier: the host holds the first host_slots experts; the others
    // are read through the store when chosen (every MoE layer has the
    // first one's format: checked above). Tiers without disk: expert e <
    // slots goes to VRAM slot e, the others to host slot e - slots.
    const bool on_disk = tiered && m.tiers->disk();
    const int held = on_disk ? m.tiers->host_slots() : E;
    const int vslots = tiered && !on_disk ? m.tiers->vram_slots() : 0;
    if (on_disk) {
      if (moe_index == 0) m.disk_layers.clear();
      m.disk_layers.push_back(i);
      if (moe_index == 0)
        m.tiers->set_loader([&store, &m, dt, q = d.q, gg = d.gg, gd = d.gd](int l, int e, uint8_t* gu, uint8_t* dn) {
          const int64_t layer = m.disk_layers.at(size_t(l));
          const ExpertBatch b = store.fetch(layer, {e});
          const FfnExpert& x = b.experts.at(0);
          const std::string where = "layer " + std::to_string(layer) + " ";
          if (gg.n) {
            CudaModel::Impl::write_gguf_expert(x, 0, gg, gd, where, gu);
            CudaModel::Impl::write_gguf_expert(x, 1, gg, gd, where, dn);
          } else if (q.bits) {
            CudaModel::Impl::write_quant(x, 0, q, where, gu);
            CudaModel::Impl::write_quant(x, 1, q, where, dn);
          } else {
            CudaModel::Impl::write_rows_host({x.gate, x.up}, dt, gu);
            CudaModel::Impl::write_rows_host({x.down}, dt, dn);
          }
        });
    }
    // A batch of experts at a time: bounded host memory for streamed ones.
    constexpr int kBatch = 16;
    std::vector<uint8_t> stage;
    for (int e0 = 0; e0 < held; e0 += kBatch) {
      const int n = std::min(kBatch, held - e0);
      std::vector<int32_t> ids(static_cast<size_t>(n));
      std::iota(ids.begin(), ids.end(), e0);
      const ExpertBatch b = store.fetch(i, ids);
      stage.resize(size_t(n) * std::max(s_gu, s_dn));
      for (int part = 0; part < 2; ++part) {
        const size_t bytes = part == 0 ? gu_bytes : dn_bytes, sb = part == 0 ? s_gu : s_dn;
        for (int k = 0; k < n; ++k) {
          const int e = e0 + k;
          // Pinned host memory is written in place; VRAM through the stage.
          uint8_t* o = stage.data() + size_t(k) * sb;
          if (on_disk) o = (part == 0 ? gu_dst : dn_dst) + size_t(e) * bytes;
          else if (tiered && e >= vslots) o = (part == 0 ? gu_dst : dn_dst) + size_t(e - vslots) * bytes;
          const FfnExpert& x = b.experts[size_t(k)];
          if (gguf) CudaModel::Impl::write_gguf_expert(x, part, sg, sd, p, o);
          else if (d.q.bits) CudaModel::Impl::write_quant(x, part, d.q, p, o);
          else if (part == 0) CudaModel::Impl::write_rows_host({x.gate, x.up}, dt, o);
          else CudaModel::Impl::write_rows_host({x.down}, dt, o);
          if (tiered && !on_disk && e < vslots)
            CK(cudaMemcpy(part == 0 ? m.tiers->vram_gu(moe_index, e) : m.tiers->vram_down(moe_index, e), o, bytes,
                          cudaMemcpyHostToDevice));
        }
        uint8_t* dst = (part == 0 ? gu_dst : dn_dst) + size_t(e0) * bytes;
        if (chunks)
          gc_upload_experts(stage.data(), sb, part == 0 ? sg : sd, dst, bytes, part == 0 ? d.gg : d.gd,
                            part == 0 ? H : I, n, scratch);
        else if (!tiered)
          CK(cudaMemcpy(dst, stage.data(), size_t(n) * bytes, cudaMemcpyHostToDevice));
      }
    }
    if (moe_index == 0) tier_gu = gu_bytes, tier_dn = dn_bytes;
    if (f.has_shared) {
      d.has_shared = true;
      // FP8 beside FP8 routed experts (their kernels read it: fp8_experts.cuh).
      const bool f8 = d.q.fp8 && f.shared.gate.fp8() && f.shared.up.fp8() && f.shared.down.fp8();
      d.s_gu = m.upload_rows({f.shared.gate, f.shared.up}, p + "shared expert", f8 ? -1 : dt, f8);
      d.s_down = m.upload_rows({f.shared.down}, p + "shared expert", f8 ? -1 : dt, f8);
      if (d.s_gu.dt != d.s_down.dt)
        fail_device(DeviceFailure::Unsupported, "CUDA backend: " + p + "shared expert: gate/up and down differ in FP8 blocks");
      if (d.s_gu.dt == DT_FP8) d.edt = DT_FP8;
      // Beside routed experts in the chunk layout, a shared expert stored
      // as they are gets a copy in that layout too (the decode step's
      // kernels read it as one more routed slot); the prefill reads the
      // stored one.
      if (chunks && d.s_gu.dt == DT_GGUF && d.s_down.dt == DT_GGUF &&
          gc_shared_joins(GExperts{sg, sd, d.s_gu.g, d.s_down.g}, I, d.s_down.cols)) {
        d.s_gu_c = m.alloc(gu_bytes, p + "shared expert (chunk layout)");
        d.s_down_c = m.alloc(dn_bytes, p + "shared expert (chunk layout)");
        gc_copy_shared(d.s_gu.p, d.s_gu.g, d.s_down.p, d.s_down.g, d.s_gu_c, d.s_down_c, d.gg, d.gd, H, I);
        m.bytes_total += int64_t(gu_bytes + dn_bytes);
      }
    }
  } else {
    int dt = storage_dt(f.dense.gate);
    if (storage_dt(f.dense.up) != dt || storage_dt(f.dense.down) != dt) dt = DT_F32;
    d.edt = dt;
    d.has_shared = true;
    d.s_gu = m.upload_rows({f.dense.gate, f.dense.up}, p + "mlp", dt);
    d.s_down = m.upload_rows({f.dense.down}, p + "mlp", dt);
  }
  // The GGUF expert kernels take every part of a layer's feed-forward in
  // a block format (a file mixing float and block tensors there has none).
  const bool gguf_ffn = d.gg.n || d.s_gu.dt == DT_GGUF || d.s_down.dt == DT_GGUF;
  if (gguf_ffn && ((moe && !d.gg.n) || (d.has_shared && (d.s_gu.dt != DT_GGUF || d.s_down.dt != DT_GGUF))))
    fail_device(DeviceFailure::Unsupported, "CUDA backend: " + p +
                                                "feed-forward mixes GGUF block types with float tensors");
  return d;
}

std::unique_ptr<CudaModel> CudaModel::upload(const QwenModel& model, const CudaOptions& o) {
  std::unique_ptr<CudaModel> cm(new CudaModel);
  Impl& m = *cm->p_;
  m.c = model.config();
  m.plan = make_plan(m.c);
  m.opts = o;
  m.init_device();
  const ModelWeights& w = model.weights();
  // A tied embedding is repacked as the lm_head (the embedding kernels read
  // repacked rows through gguf_weights8 as well).
  const bool tied = w.lm_head.data == w.embed.data;
  m.embed = m.upload_rows({w.embed}, "embedding", -1, false, tied);
  m.lm_head = tied ? m.embed : m.upload_rows({w.lm_head}, "lm_head", -1, false, true);
  m.final_norm = m.upload_vec(w.final_norm, "final norm");
  size_t tier_gu = 0, tier_dn = 0;
  bool tiered = false;
  for (const LayerPlan& l : m.plan.layers) {
    const int64_t i = l.index;
    m.L.push_back(upload_layer(m, l, w.layers[size_t(i)], model.expert_store(), i,
                               "layer " + std::to_string(i) + " ", true, tiered, tier_gu, tier_dn));
  }
  // The MTP head (--mtp), its experts in VRAM; not beside a tiered cache,
  // whose memory plan did not count it (drafting is refused there).
  if (w.mtp && model.plan().mtp && !m.tiers) m.upload_mtp(model);
  if (m.tiers) m.tiers->start();
  model.expert_store().reset_stats();  // the upload's reads are not the run's
  m.init_common();
  return cm;
}

CudaTierStats CudaModel::tier_stats() const {
  Impl& m = *p_;
  if (!m.tiers) return {};
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  CudaTierStats s = m.tiers->stats();
  s.prefetched = m.pf_copies;
  s.copied_after = m.pf_rest_copies;
  if (m.pf_used) CK(cudaMemcpy(&s.prefetch_used, m.pf_used, 8, cudaMemcpyDeviceToHost));
  return s;
}

void CudaModel::reset_tier_stats() {
  Impl& m = *p_;
  if (!m.tiers) return;
  CK(cudaSetDevice(m.dev));
  CK(cudaStreamSynchronize(m.stream));
  m.tiers->reset_stats();
  m.pf_copies = 0;
  m.pf_rest_copies = 0;
  if (m.pf_used) CK(cudaMemset(m.pf_used, 0, 8));
}

}  // namespace flashmoe
