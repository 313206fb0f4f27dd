#include "runtime/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "backend/cuda/cuda_model.h"
#include "core/error.h"
#include "kv/kv_config.h"
#include "kv/memory_calc.h"
#include "model/qwen_model.h"

namespace flashmoe {

namespace {

constexpr int64_t kGiB = int64_t(1) << 30;

std::string gb(int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GB", double(bytes) / 1e9);
  return b;
}

// The part of the model that does not fit anywhere: the numbers a user needs.
std::string where_it_stands(const MemoryPlan& p, int64_t vram_room, int64_t host_bound) {
  const int64_t all = int64_t(p.experts) * p.moe_layers * p.expert_bytes;
  return "the routed experts take " + gb(all) + " (" + std::to_string(p.experts) + " per layer x " +
         std::to_string(p.moe_layers) + " layers x " + gb(p.expert_bytes) + "); VRAM has " + gb(vram_room) +
         " for them (" + gb(p.vram_free) + " free less " + gb(p.device_fixed) + " for the other weights and buffers and a " +
         gb(p.vram_margin) + " margin) and host memory can pin " + gb(host_bound) + " (" + gb(p.host_available) + " " +
         p.host_source + " less a " + gb(p.host_margin) + " margin)";
}

}  // namespace

int64_t vram_margin(const MachineMemory&) { return 4 * kGiB; }

int64_t host_margin(const MachineMemory& m) { return std::max<int64_t>(8 * kGiB, m.host_available / 10); }

MemoryPlan plan_memory(const MachineMemory& m, const ModelFootprint& f, const GpuOptions& o) {
  MemoryPlan p;
  p.moe_layers = f.moe_layers;
  p.experts = f.experts;
  p.expert_bytes = f.expert_bytes;
  p.device_fixed = f.device_fixed;
  p.swap_spares = f.swap_spares;
  p.vram_free = m.vram_free;
  p.vram_margin = vram_margin(m);
  p.host_available = m.host_available;
  p.host_margin = host_margin(m);
  p.host_source = m.host_source;
  const int E = f.experts;
  const int64_t per_slot = int64_t(f.moe_layers) * f.expert_bytes;  // one slot in every MoE layer
  const int64_t vram_room = m.vram_free - f.device_fixed - p.vram_margin;
  const int64_t host_bound = std::max<int64_t>(0, m.host_available - p.host_margin);
  if (vram_room < 0)
    fail(f.name + ": the weights other than the routed experts and the buffers take about " + gb(f.device_fixed) +
         " of VRAM; " + gb(m.vram_free) + " is free, less a " + gb(p.vram_margin) + " margin" +
         (f.smaller_model_hint.empty() ? "" : "; " + f.smaller_model_hint));
  if (E <= 0 || per_slot <= 0) {
    p.vram_slots = E;
    return p;
  }
  const int64_t all = int64_t(E) * per_slot;
  // Tiered, with more than one MoE layer: a VRAM buffer for one layer's host
  // experts, which prompts copy in at once (ExpertTiers::stage).
  auto staging = [&](int64_t slots) { return slots < E && f.moe_layers > 1 ? (E - slots) * f.expert_bytes : 0; };
  int64_t slots;
  if (o.expert_cache_gb >= 0 || o.expert_cache_fraction >= 0) {
    const double budget = o.expert_cache_gb >= 0 ? o.expert_cache_gb * 1e9 : o.expert_cache_fraction * double(all);
    slots = std::clamp<int64_t>(int64_t(budget / double(per_slot)), 0, E);
    const int64_t taken = (slots < E ? slots + f.swap_spares : slots) * per_slot + staging(slots);
    if (taken > vram_room)
      fail("--gpu-expert-cache: " + std::to_string(slots) + " experts per layer in VRAM take " + gb(taken) +
           (slots < E ? " (with " + std::to_string(f.swap_spares) + " spare slots per layer for promotions)" : "") +
           ", more than the " + gb(vram_room) + " VRAM has for them (" + gb(m.vram_free) + " free less " +
           gb(f.device_fixed) + " for the other weights and buffers and a " + gb(p.vram_margin) +
           " margin); give it at most that, or auto");
  } else {
    // auto, and the default: all when they fit, else what fits beside the spare slots.
    slots = std::min<int64_t>(E, vram_room / per_slot);
    if (slots < E) slots = std::max<int64_t>(0, slots - f.swap_spares);
    // Each slot given up frees a slot in every layer and takes one expert of staging.
    while (slots > 0 && slots < E && (slots + f.swap_spares) * per_slot + staging(slots) > vram_room) --slots;
    if (slots < E && (slots + f.swap_spares) * per_slot + staging(slots) > vram_room)
      fail(f.name + ": VRAM has " + gb(vram_room) + " for routed experts, less than the " +
           std::to_string(f.swap_spares) + " spare slots per layer of the tiered cache take (" +
           gb(f.swap_spares * per_slot) + ")" + (f.smaller_model_hint.empty() ? "" : "; " + f.smaller_model_hint));
  }
  p.vram_slots = int(slots);
  if (slots >= E) return p;
  p.staging_bytes = staging(slots);
  p.tiered = true;
  const int rest = E - int(slots);
  int64_t host;
  if (o.host_cache_gb >= 0 || o.host_cache_fraction >= 0) {
    const double budget = o.host_cache_gb >= 0 ? o.host_cache_gb * 1e9 : o.host_cache_fraction * double(all);
    host = std::clamp<int64_t>(int64_t(budget / double(per_slot)), 0, rest);
    if (host * per_slot > host_bound)
      fail("--gpu-host-cache: " + std::to_string(host) + " experts per layer in pinned host memory take " +
           gb(host * per_slot) + ", more than the " + gb(host_bound) + " host memory can pin (" +
           gb(m.host_available) + " " + m.host_source + " less a " + gb(p.host_margin) + " margin)");
  } else {
    host = std::min<int64_t>(rest, host_bound / per_slot);
  }
  p.host_slots = int(host);
  if (host >= rest) return p;
  if (!f.has_files)
    fail(f.name + ": does not fit: " + where_it_stands(p, vram_room, host_bound) + "; " + gb((rest - host) * per_slot) +
         " are left over and a synthetic model has no files to read them from" +
         (f.smaller_model_hint.empty() ? "" : "; " + f.smaller_model_hint));
  p.disk = true;
  if (host < f.top_k)
    fail(f.name + ": host memory can hold " + std::to_string(host) + " experts per layer, fewer than the " +
         std::to_string(f.top_k) + " one token uses: " + where_it_stands(p, vram_room, host_bound) +
         "; free host memory or give --gpu-host-cache");
  return p;
}

std::string MemoryPlan::describe() const {
  char b[512];
  std::string out = "memory plan (made before allocating):\n";
  const int64_t total = int64_t(experts) * moe_layers;
  std::snprintf(b, sizeof b,
                "  VRAM: %.1f GB free = %.1f GB other weights and buffers (estimate) + %.1f GB margin + %.1f GB for "
                "%lld routed experts (%d of %d per layer, %.0f%%)\n",
                vram_free / 1e9, device_fixed / 1e9, vram_margin / 1e9,
                double(vram_free - device_fixed - vram_margin) / 1e9, (long long)(int64_t(vram_slots) * moe_layers),
                vram_slots, experts, total > 0 ? 100.0 * vram_slots * moe_layers / double(total) : 100.0);
  out += b;
  const std::string extra = tiered ? " + " + std::to_string(swap_spares) + " spare slots per layer for promotions + " +
                                        std::to_string(staging_bytes / 1000000) + " MB staging for prompts"
                                  : "";
  std::snprintf(b, sizeof b, "  experts in VRAM: %.1f GB (%lld experts of %.2f MB)%s\n", vram_expert_bytes() / 1e9,
                (long long)(int64_t(vram_slots) * moe_layers), expert_bytes / 1e6, extra.c_str());
  out += b;
  std::snprintf(b, sizeof b,
                "  host: %.1f GB available (%s) - %.1f GB margin; pinned for experts: %.1f GB (%lld experts, %d per "
                "layer)\n",
                host_available / 1e9, host_source.c_str(), host_margin / 1e9, host_expert_bytes() / 1e9,
                (long long)(int64_t(host_slots) * moe_layers), host_slots);
  out += b;
  if (disk)
    std::snprintf(b, sizeof b, "  disk: %.1f GB (%lld experts) read from the model's files when chosen",
                  disk_expert_bytes() / 1e9, (long long)(int64_t(experts - vram_slots - host_slots) * moe_layers));
  else
    std::snprintf(b, sizeof b, "  disk: none");
  out += b;
  return out;
}

void probe_host_memory(MachineMemory* m) {
  int64_t avail = -1;
  {
    std::ifstream f("/proc/meminfo");
    std::string key, unit;
    int64_t v = 0;
    while (f >> key >> v) {
      std::getline(f, unit);
      if (key == "MemAvailable:") {
        avail = v * 1024;
        break;
      }
    }
  }
  m->host_available = std::max<int64_t>(0, avail);
  m->host_source = "MemAvailable";
  // cgroup v2: the limit less what the group already uses.
  std::ifstream lim("/sys/fs/cgroup/memory.max"), cur("/sys/fs/cgroup/memory.current");
  std::string l;
  int64_t used = 0;
  if (lim >> l && l != "max" && cur >> used) {
    try {
      const int64_t left = std::max<int64_t>(0, std::stoll(l) - used);
      if (avail < 0 || left < m->host_available) {
        m->host_available = left;
        m->host_source = "under the cgroup limit (memory.max - memory.current)";
      }
    } catch (...) {
    }
  }
}

int64_t device_fixed_bytes(const ModelConfig& c, int weight_bytes, int64_t expert_bytes, int64_t context,
                           bool staging) {
  const int64_t H = c.hidden_size, V = c.vocab_size, wb = weight_bytes;
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int64_t nv = c.lin_num_v_heads, dv = c.lin_v_dim, C = c.lin_conv_dim(), K = c.conv_kernel;
  const int64_t E = c.num_experts, k = std::max<int64_t>(1, c.num_experts_per_tok), I = c.moe_intermediate;
  const int64_t Is = c.shared_intermediate;
  int64_t w = V * H * wb * (c.tie_word_embeddings ? 1 : 2);
  int64_t rmax = 1, omax = 1;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool full = c.layer_kinds.at(size_t(i)) == LayerKind::Full;
    const int64_t rows = full ? 2 * nh * hd + 2 * nkv * hd : C + nv * dv + 2 * nv;
    const int64_t O = full ? nh * hd : nv * dv;
    rmax = std::max(rmax, rows);
    omax = std::max(omax, O);
    w += (rows + O) * H * wb + 2 * H * 4;
    if (!full) w += C * K * 4 + 3 * nv * 4 + dv * 4;
    if (c.layer_is_moe.at(size_t(i))) {
      const int64_t router = E + (Is > 0 ? 1 : 0);
      w += router * H * wb + 3 * Is * H * wb;
      w += router * (H + O) * 4;  // the router folded into the output projection (f32)
      w += 3 * E * 8 + E * 4;     // pointer tables, tier marks and counts
    } else {
      w += 3 * c.intermediate_size * H * wb;
    }
  }
  // The batched prefill at 2048-token chunks (Prefill::allocate), f32 and bf16 buffers.
  const int64_t T = 2048;
  const int64_t ymax = std::max({T * omax, T * k * I, T * std::max<int64_t>(1, Is)});
  const int64_t prefill = T * 4 * (3 * H + rmax + C + omax + nh * hd + 2 * nv + (E + 1) + (k + 1) + k * I + Is + k * H) +
                          T * 12 * k + 2 * (2 * T * H + 2 * ymax) + 32 * V * 4 + T * nkv * hd * 8 + T * 4 * 64 * 2;
  // The decode step's buffers: small next to the above, and the logits.
  const int64_t decode = V * 4 * 2 + (H * 8 + rmax + C + (k + 1) * I) * 4;
  KvConfig kv;
  const int64_t state = kv_cache_bytes(c, kv, context) + kv_memory(c, kv).constant_bytes();
  return w + prefill + decode + state + (staging ? E * expert_bytes : 0);
}

int64_t device_expert_bytes(int bits, int group, int64_t H, int64_t I, int float_bytes) {
  if (bits == 0) return 3 * H * I * float_bytes;
  auto up16 = [](int64_t x) { return (x + 15) / 16 * 16; };
  const int64_t gw = I * (H * bits / 8), gs = I * (H / group) * 2;
  const int64_t gu = up16(up16(up16(up16(up16(up16(gw) + gs) + gs) + gw) + gs) + gs);
  const int64_t dw = H * (I * bits / 8), ds = H * (I / group) * 2;
  const int64_t dn = up16(up16(up16(dw) + ds) + ds);
  return gu + dn;
}

namespace {
ModelFootprint footprint_of(const ModelConfig& c, int64_t expert_bytes) {
  ModelFootprint f;
  f.expert_bytes = expert_bytes;
  f.experts = int(c.num_experts);
  f.top_k = int(c.num_experts_per_tok);
  for (int64_t i = 0; i < c.num_layers; ++i)
    if (c.num_experts > 0 && c.layer_is_moe.at(size_t(i))) ++f.moe_layers;
  return f;
}
}  // namespace

ModelFootprint synthetic_footprint(const ModelConfig& c, int bits, int group, int64_t context) {
  ModelFootprint f = footprint_of(c, device_expert_bytes(bits, group, c.hidden_size, c.moe_intermediate));
  f.name = "synthetic model (" + std::to_string(c.num_layers) + " layers)";
  f.device_fixed = device_fixed_bytes(c, 2, f.expert_bytes, context, true);
  f.smaller_model_hint = "use fewer layers (--layers N)";
  f.swap_spares = kTierSwapSpares;
  return f;
}

ModelFootprint model_footprint(const QwenModel& m, int64_t context) {
  const ModelConfig& c = m.config();
  const ModelWeights& w = m.weights();
  // The upload keeps float weights as stored and dequantises q8/q4 ones to f32.
  const Matrix& e = w.embed;
  const int wb = e.quantized() ? 4 : int(dtype_size(e.dtype));
  int64_t expert = 0;
  for (int64_t i = 0; i < c.num_layers && c.num_experts > 0; ++i) {
    if (!c.layer_is_moe.at(size_t(i))) continue;
    // The first expert through the store (checkpoint views or packed files), as the upload reads it.
    const ExpertBatch b = m.expert_store().fetch(i, {0});
    const FfnExpert& x = b.experts.at(0);
    const Matrix& g = x.gate;
    // FP8 and GGUF block experts stay as stored on the device (FP8 adds its
    // per-row block scales: 4 bytes per 128 weights at most).
    const int64_t stored = int64_t(x.gate.nbytes() + x.up.nbytes() + x.down.nbytes());
    expert = g.affine()      ? device_expert_bytes(quant_bits(g.quant), g.group, c.hidden_size, c.moe_intermediate)
             : g.fp8()       ? stored + stored / 32 + 64
             : g.quantized() ? stored + 64
                             : device_expert_bytes(0, 0, c.hidden_size, c.moe_intermediate, int(dtype_size(g.dtype)));
    break;
  }
  ModelFootprint f = footprint_of(c, expert);
  f.name = "the model";
  f.device_fixed = device_fixed_bytes(c, wb, expert, context, false);
  f.has_files = true;
  f.swap_spares = kTierSwapSpares;
  return f;
}

}  // namespace flashmoe
