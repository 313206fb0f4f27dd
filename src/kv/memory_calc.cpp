#include "kv/memory_calc.h"

#include <cctype>
#include <cstdarg>
#include <cstdio>

#include "core/error.h"

namespace flashmoe {

KvMemory kv_memory(const ModelConfig& m, const KvConfig& cfg) {
  KvMemory r;
  r.full_layers = m.num_full_layers();
  r.linear_layers = m.num_linear_layers();
  r.data_bytes_per_position = r.full_layers * 2 * m.num_kv_heads * m.head_dim * int64_t(kv_elem_size(cfg.dtype));
  const bool channel = cfg.dtype == KvDType::FP8 && cfg.fp8_scale == Fp8ScaleMode::Channel;
  if (cfg.dtype == KvDType::FP8)
    r.scale_bytes_per_position = channel ? r.full_layers * m.num_kv_heads * (3 + 2)
                                         : r.full_layers * 2 * 4 * (cfg.fp8_scale != Fp8ScaleMode::Position ? m.num_kv_heads : 1);
  if (channel) {
    r.offset_bytes_per_page = r.full_layers * m.num_kv_heads * m.head_dim * 4;
    r.query_moment_bytes = r.full_layers * m.num_kv_heads * (m.head_dim * (m.head_dim + 1) / 2) * 4;
    r.page_sum_bytes = r.full_layers * m.num_kv_heads * m.head_dim * 4;
  }
  r.gdn_state_bytes = r.linear_layers * m.lin_num_v_heads * m.lin_k_dim * m.lin_v_dim * 4;
  r.conv_state_bytes = r.linear_layers * m.lin_conv_dim() * (m.conv_kernel - 1) * 4;
  return r;
}

int64_t KvMemory::cache_bytes(int64_t positions) const {
  if (positions <= 0) return 0;
  return bytes_per_position() * positions + (positions + kFp8OffsetPage - 1) / kFp8OffsetPage * offset_bytes_per_page +
         sequence_bytes();
}

int64_t kv_cache_bytes(const ModelConfig& m, const KvConfig& cfg, int64_t context) {
  return kv_memory(m, cfg).cache_bytes(cfg.retained(context));
}

std::string format_bytes(int64_t bytes) {
  static const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = double(bytes) / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

std::vector<int64_t> parse_context_list(const std::string& s) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string tok = s.substr(i, j - i);
    while (!tok.empty() && std::isspace(static_cast<unsigned char>(tok.back()))) tok.pop_back();
    while (!tok.empty() && std::isspace(static_cast<unsigned char>(tok.front()))) tok.erase(0, 1);
    int64_t mult = 1;
    if (!tok.empty() && (tok.back() == 'k' || tok.back() == 'K')) mult = 1024, tok.pop_back();
    else if (!tok.empty() && (tok.back() == 'm' || tok.back() == 'M')) mult = 1024 * 1024, tok.pop_back();
    bool ok = !tok.empty() && tok.size() <= 12;
    for (char c : tok) ok = ok && std::isdigit(static_cast<unsigned char>(c));
    if (!ok || std::stoll(tok) <= 0)
      fail("bad context list '" + s + "' (expected positive token counts like 4096,32768,128k)");
    out.push_back(std::stoll(tok) * mult);
    i = j + 1;
  }
  return out;
}

namespace {

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string retention_name(const KvConfig& c) {
  switch (c.retention()) {
    case KvRetention::Full: return "full";
    case KvRetention::Window: return "window " + std::to_string(c.window);
    case KvRetention::Streaming: return "streaming " + std::to_string(c.window) + " (sinks " + std::to_string(c.sinks) + ")";
    case KvRetention::H2O:
      return "h2o " + std::to_string(c.h2o_budget) + " (sinks " + std::to_string(c.sinks) + ", recent " +
             std::to_string(c.h2o_recent()) + ")";
    case KvRetention::Tova:
      return "tova " + std::to_string(c.tova_budget) + " (sinks " + std::to_string(c.sinks) + ", recent " +
             std::to_string(c.evict_protected_recent()) + ")";
    case KvRetention::SnapKV:
      return "snapkv " + std::to_string(c.snapkv_budget) + " (sinks " + std::to_string(c.sinks) + ", window " +
             std::to_string(c.snapkv_recent()) + "; the whole prompt until decoding starts)";
    case KvRetention::Quest:
      return "quest: all positions stored, " + std::to_string(c.resident) + " resident per query, pages of " +
             std::to_string(c.page) + " (" + quest_select_name(c.quest_select) + " selection)";
  }
  return "?";
}

std::string config_label(const KvConfig& c) {
  std::string s = kv_dtype_name(c.dtype);
  if (c.dtype == KvDType::FP8) s += std::string("/") + fp8_scale_mode_name(c.fp8_scale);
  return s;
}

}  // namespace

std::string kv_calc_report(const ModelConfig& m, const std::string& model_name, const KvConfig& cfg,
                           const std::vector<int64_t>& contexts) {
  const KvMemory mem = kv_memory(m, cfg);
  std::string o;
  o += fmt("model: %s (%s): %lld layers = %lld full attention + %lld GatedDeltaNet\n", model_name.c_str(),
           m.model_type.c_str(), (long long)m.num_layers, (long long)mem.full_layers, (long long)mem.linear_layers);
  o += fmt("full attention: %lld KV heads x %lld head_dim; GatedDeltaNet: nv %lld x dk %lld x dv %lld, conv dim %lld, kernel %lld\n",
           (long long)m.num_kv_heads, (long long)m.head_dim, (long long)m.lin_num_v_heads, (long long)m.lin_k_dim,
           (long long)m.lin_v_dim, (long long)m.lin_conv_dim(), (long long)m.conv_kernel);
  o += "KV cache: " + config_label(cfg) + ", retention " + retention_name(cfg) + "\n\n";

  o += fmt("KV per position: %lld B (%s)", (long long)mem.bytes_per_position(),
           format_bytes(mem.bytes_per_position()).c_str());
  if (mem.scale_bytes_per_position > 0)
    o += fmt(" = %lld B K/V data (%s) + %lld B fp8 scales", (long long)mem.data_bytes_per_position,
             format_bytes(mem.data_bytes_per_position).c_str(), (long long)mem.scale_bytes_per_position);
  if (mem.offset_bytes_per_page > 0)
    o += fmt(" + %lld B key offsets per page of %lld positions", (long long)mem.offset_bytes_per_page,
             (long long)kFp8OffsetPage);
  o += fmt("\n  = %lld full-attention layers x 2 (K,V) x %lld KV heads x %lld head_dim x %zu B\n",
           (long long)mem.full_layers, (long long)m.num_kv_heads, (long long)m.head_dim, kv_elem_size(cfg.dtype));
  if (mem.sequence_bytes() > 0)
    o += fmt("KV per sequence (in the KV cache column, whatever the context): %lld B = %lld B query second moments "
             "(%lld layers x %lld KV heads x %lld x %lld / 2 x 4 B, a packed f32 triangle) + %lld B current page's "
             "key sums (%lld x %lld x %lld x 4 B)\n",
             (long long)mem.sequence_bytes(), (long long)mem.query_moment_bytes, (long long)mem.full_layers,
             (long long)m.num_kv_heads, (long long)m.head_dim, (long long)(m.head_dim + 1), (long long)mem.page_sum_bytes,
             (long long)mem.full_layers, (long long)m.num_kv_heads, (long long)m.head_dim);
  if (cfg.retention() == KvRetention::Quest) {
    // Beside the stored positions: the per-page key bounds (f32 min and max
    // per channel), and the positions one query reads.
    const int64_t bound = mem.full_layers * m.num_kv_heads * m.head_dim * 2 * 4;
    o += fmt("quest page key bounds: %lld B per page of %lld positions (%lld layers x %lld KV heads x %lld head_dim "
             "x min,max x 4 B); each query reads at most %lld positions x %lld B = %s\n",
             (long long)bound, (long long)cfg.page, (long long)mem.full_layers, (long long)m.num_kv_heads,
             (long long)m.head_dim, (long long)cfg.resident, (long long)mem.bytes_per_position(),
             format_bytes(cfg.resident * mem.bytes_per_position()).c_str());
  }
  o += fmt("GatedDeltaNet state (constant): %s recurrent (%lld x %lld x %lld x %lld x 4 B) + %s conv "
           "(%lld x %lld x %lld x 4 B) = %s\n\n",
           format_bytes(mem.gdn_state_bytes).c_str(), (long long)mem.linear_layers, (long long)m.lin_num_v_heads,
           (long long)m.lin_k_dim, (long long)m.lin_v_dim, format_bytes(mem.conv_state_bytes).c_str(),
           (long long)mem.linear_layers, (long long)m.lin_conv_dim(), (long long)(m.conv_kernel - 1),
           format_bytes(mem.constant_bytes()).c_str());

  // "vs f32": the KV cache column (everything it holds per sequence) over
  // f32's for the same retained positions.
  KvConfig f32cfg = cfg;
  f32cfg.dtype = KvDType::F32;
  const KvMemory f32mem = kv_memory(m, f32cfg);
  o += fmt("%10s %10s %14s %9s %14s %14s\n", "context", "positions", "KV cache", "vs f32", "GDN state", "total");
  for (int64_t ctx : contexts) {
    const int64_t kv = mem.cache_bytes(cfg.retained(ctx)), ref = f32mem.cache_bytes(cfg.retained(ctx));
    o += fmt("%10lld %10lld %14s %8.2f%% %14s %14s\n", (long long)ctx, (long long)cfg.retained(ctx),
             format_bytes(kv).c_str(), ref > 0 ? 100.0 * double(kv) / double(ref) : 0.0,
             format_bytes(mem.constant_bytes()).c_str(), format_bytes(kv + mem.constant_bytes()).c_str());
  }

  o += "\ncomparison (retention " + retention_name(cfg) + "), KV cache per context:\n";
  o += fmt("%-14s %14s", "dtype", "per position");
  for (int64_t ctx : contexts) o += fmt(" %12lld", (long long)ctx);
  o += "\n";
  const struct { KvDType t; Fp8ScaleMode s; } rows[] = {{KvDType::F32, Fp8ScaleMode::Position},
                                                         {KvDType::BF16, Fp8ScaleMode::Position},
                                                         {KvDType::F16, Fp8ScaleMode::Position},
                                                         {KvDType::FP8, Fp8ScaleMode::Position},
                                                         {KvDType::FP8, Fp8ScaleMode::Head},
                                                         {KvDType::FP8, Fp8ScaleMode::Rotated},
                                                         {KvDType::FP8, Fp8ScaleMode::Channel}};
  for (const auto& r : rows) {
    // channel offsets belong to pages of consecutive positions: full or quest only.
    if (r.s == Fp8ScaleMode::Channel && cfg.retention() != KvRetention::Full && cfg.retention() != KvRetention::Quest)
      continue;
    KvConfig c = cfg;
    c.dtype = r.t;
    c.fp8_scale = r.s;
    const KvMemory cm = kv_memory(m, c);
    o += fmt("%-14s %14s", config_label(c).c_str(), format_bytes(cm.bytes_per_position()).c_str());
    for (int64_t ctx : contexts) o += fmt(" %12s", format_bytes(cm.cache_bytes(c.retained(ctx))).c_str());
    o += "\n";
  }
  return o;
}

}  // namespace flashmoe
