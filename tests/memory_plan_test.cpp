// The GPU memory plan (runtime/memory_plan.h) on made-up machines: every
// expectation below is worked out by hand from the sizes given (margins:
// 4 GiB of VRAM; host max(8 GiB, 10% of what is available)).
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "kv/presets.h"
#include "runtime/memory_plan.h"

namespace flashmoe::memory_plan_test {
namespace {

constexpr int64_t GiB = int64_t(1) << 30, MiB = int64_t(1) << 20;

// 80 GiB of free VRAM, 100 GiB of host memory available.
MachineMemory machine(int64_t vram_gib = 80, int64_t host_gib = 100) {
  MachineMemory m;
  m.vram_free = vram_gib * GiB;
  m.vram_total = m.vram_free;
  m.host_available = host_gib * GiB;
  m.host_source = "MemAvailable";
  return m;
}

// 4 MoE layers of `experts` experts of 64 MiB (one slot in every layer: 256
// MiB), 10 GiB of other weights and buffers, top-10, 2 spare VRAM slots per
// layer when tiered.
ModelFootprint model(int experts, bool files = false) {
  ModelFootprint f;
  f.name = "synthetic model";
  f.device_fixed = 10 * GiB;
  f.expert_bytes = 64 * MiB;
  f.moe_layers = 4;
  f.experts = experts;
  f.top_k = 10;
  f.has_files = files;
  f.smaller_model_hint = "use fewer layers (--layers N)";
  f.swap_spares = 2;
  return f;
}

std::string error_of(const MachineMemory& m, const ModelFootprint& f, const GpuOptions& o) {
  try {
    plan_memory(m, f, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MemoryPlan, EveryExpertInVramWhenTheyFit) {
  // 64 experts x 256 MiB = 16 GiB <= 80 - 10 - 4 = 66 GiB.
  const MemoryPlan p = plan_memory(machine(), model(64), {});
  EXPECT_FALSE(p.tiered);
  EXPECT_EQ(p.vram_slots, 64);
  EXPECT_EQ(p.host_slots, 0);
}

TEST(MemoryPlan, AutoFillsVramThenHostEachExpertInOneTier) {
  // 512 experts: 128 GiB. VRAM room 66 GiB = 67584 MiB for s slots of 256
  // MiB, 2 spare slots and the prompt staging of one layer's 512 - s host
  // experts of 64 MiB: (s + 2) x 256 + (512 - s) x 64 <= 67584 gives
  // s <= 178.67: 178 (45568 + 512 + 21376 = 67456 MiB). The other 334
  // (83.5 GiB) fit the host bound 100 - 10 = 90 GiB.
  const MemoryPlan p = plan_memory(machine(), model(512), {});
  EXPECT_TRUE(p.tiered);
  EXPECT_FALSE(p.disk);
  EXPECT_EQ(p.vram_slots, 178);
  EXPECT_EQ(p.host_slots, 334);
  EXPECT_EQ(p.staging_bytes, 334 * 64 * MiB);
  EXPECT_EQ(p.vram_expert_bytes(), 178 * 256 * MiB);
  EXPECT_EQ(p.host_expert_bytes(), 334 * 256 * MiB);
  EXPECT_EQ(p.disk_expert_bytes(), 0);
  EXPECT_EQ(p.host_margin, 10 * GiB);
  EXPECT_NE(p.describe().find("178 of 512 per layer"), std::string::npos) << p.describe();
  EXPECT_NE(p.describe().find("disk: none"), std::string::npos);
}

TEST(MemoryPlan, SyntheticBeyondHostIsOneErrorNamingTheNumbers) {
  // Host 40 GiB less an 8 GiB margin: 32 GiB = 128 slots < the 334 left.
  const std::string e = error_of(machine(80, 40), model(512), {});
  EXPECT_NE(e.find("does not fit"), std::string::npos) << e;
  EXPECT_NE(e.find("137.4 GB"), std::string::npos) << e;  // 128 GiB of experts
  EXPECT_NE(e.find("70.9 GB"), std::string::npos) << e;   // VRAM room 66 GiB
  EXPECT_NE(e.find("34.4 GB"), std::string::npos) << e;   // host bound 32 GiB
  EXPECT_NE(e.find("--layers"), std::string::npos) << e;
}

TEST(MemoryPlan, RealModelBeyondHostGoesToDisk) {
  const MemoryPlan p = plan_memory(machine(80, 40), model(512, true), {});
  EXPECT_TRUE(p.disk);
  EXPECT_EQ(p.vram_slots, 178);
  EXPECT_EQ(p.host_slots, 128);
  EXPECT_EQ(p.disk_expert_bytes(), 206 * 256 * MiB);  // 512 - 178 - 128 per layer
  // Host 9 GiB less 8: 1 GiB = 4 slots, fewer than top-10.
  const std::string e = error_of(machine(80, 9), model(512, true), {});
  EXPECT_NE(e.find("4 experts per layer, fewer than the 10"), std::string::npos) << e;
}

TEST(MemoryPlan, ExplicitSizesAreHonouredOrRefused) {
  GpuOptions third;
  third.expert_cache_fraction = 0.25;  // 128 slots + 2 spare + 384 x 64 MiB staging = 56.5 GiB <= 66 GiB
  // The 384 others: 96 GiB <= 120 GiB less a 12 GiB margin.
  const MemoryPlan p = plan_memory(machine(80, 120), model(512), third);
  EXPECT_EQ(p.vram_slots, 128);
  EXPECT_EQ(p.host_slots, 384);
  GpuOptions half;
  half.expert_cache_fraction = 0.5;  // 258 x 256 MiB + 256 x 64 MiB staging = 80.5 GiB > 66 GiB
  EXPECT_NE(error_of(machine(), model(512), half).find("--gpu-expert-cache: 256 experts per layer in VRAM take 86.4 GB"),
            std::string::npos)
      << error_of(machine(), model(512), half);
  GpuOptions big;
  big.expert_cache_gb = 80;  // 80e9 / 256 MiB = 298 slots (+ 2 spare) = 75 GiB, + 214 x 64 MiB staging
  const std::string e = error_of(machine(), model(512), big);
  EXPECT_NE(e.find("--gpu-expert-cache: 298 experts per layer in VRAM take 94.9 GB"), std::string::npos) << e;
  GpuOptions host;
  host.expert_cache_fraction = 0.25;
  host.host_cache_gb = 60;  // 60e9 / 256 MiB = 223 slots = 55.75 GiB > 60 - 8 = 52 GiB
  const std::string h = error_of(machine(80, 60), model(512), host);
  EXPECT_NE(h.find("--gpu-host-cache: 223 experts per layer"), std::string::npos) << h;
}

TEST(MemoryPlan, OtherWeightsBeyondVramAndMargins) {
  ModelFootprint f = model(512);
  f.device_fixed = 77 * GiB;  // 80 - 77 < the 4 GiB margin
  EXPECT_NE(error_of(machine(), f, {}).find("take about 82.7 GB"), std::string::npos);
  EXPECT_EQ(host_margin(machine(80, 200)), 20 * GiB);
  EXPECT_EQ(host_margin(machine(80, 50)), 8 * GiB);
}

TEST(MemoryPlan, ExpertBytesOfThe397bShape) {
  // q4, groups of 64, H 4096, I 1024: gate/up 2 x (1024 x 2048 data + 2 x
  // 1024 x 64 x 2 scales/biases) = 4,718,592; down 4096 x 512 + 2 x 4096 x
  // 16 x 2 = 2,359,296 (all parts 16-byte aligned already).
  EXPECT_EQ(device_expert_bytes(4, 64, 4096, 1024), 7077888);
  EXPECT_EQ(device_expert_bytes(0, 0, 4096, 1024, 2), 3 * 4096 * 1024 * 2);
  // 60 layers x 512 experts: 217.4 GB, what the 60-layer run once tried to pin.
  EXPECT_EQ(int64_t(60) * 512 * 7077888, 217432719360);
}

TEST(MemoryPlan, Qwen35_397bPresetIsThePublishedConfig) {
  // Qwen/Qwen3.5-397B-A17B config.json (text_config): 60 layers, hidden 4096,
  // 512 experts, 10 per token, moe_intermediate_size 1024,
  // shared_expert_intermediate_size 1024, 32 heads / 2 KV heads of 256,
  // linear attention 16 key / 64 value heads of 128, vocab 248320, a full
  // attention layer every 4th.
  const ModelConfig c = model_preset("qwen3.5-397b-a17b");
  EXPECT_EQ(c.num_layers, 60);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.moe_intermediate, 1024);
  EXPECT_EQ(c.shared_intermediate, 1024);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.lin_num_k_heads, 16);
  EXPECT_EQ(c.lin_num_v_heads, 64);
  EXPECT_EQ(c.lin_k_dim, 128);
  EXPECT_EQ(c.lin_v_dim, 128);
  EXPECT_EQ(c.vocab_size, 248320);
  int full = 0;
  for (int64_t i = 0; i < c.num_layers; ++i) full += c.layer_kinds[size_t(i)] == LayerKind::Full;
  EXPECT_EQ(full, 15);
  EXPECT_EQ(c.layer_kinds[3], LayerKind::Full);
}

}  // namespace
}  // namespace flashmoe::memory_plan_test
