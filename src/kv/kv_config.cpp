#include "kv/kv_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace flashmoe {

const char* kv_dtype_name(KvDType t) {
  switch (t) {
    case KvDType::F32: return "f32";
    case KvDType::BF16: return "bf16";
    case KvDType::F16: return "f16";
    case KvDType::FP8: return "fp8";
  }
  return "?";
}

const char* fp8_scale_mode_name(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::Position: return "position";
    case Fp8ScaleMode::Head: return "head";
    case Fp8ScaleMode::Rotated: return "rotated";
    case Fp8ScaleMode::Channel: return "channel";
  }
  return "?";
}

size_t kv_elem_size(KvDType t) {
  switch (t) {
    case KvDType::F32: return 4;
    case KvDType::BF16: return 2;
    case KvDType::F16: return 2;
    case KvDType::FP8: return 1;
  }
  return 0;
}

static std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

KvDType parse_kv_dtype(const std::string& s) {
  const std::string l = lower(s);
  if (l == "f32" || l == "fp32" || l == "float32") return KvDType::F32;
  if (l == "bf16" || l == "bfloat16") return KvDType::BF16;
  if (l == "f16" || l == "fp16" || l == "float16") return KvDType::F16;
  if (l == "fp8" || l == "f8" || l == "e4m3" || l == "fp8_e4m3") return KvDType::FP8;
  fail("unknown KV cache dtype '" + s + "' (--kv-dtype accepts f32, bf16, f16, fp8)");
}

Fp8ScaleMode parse_fp8_scale_mode(const std::string& s) {
  const std::string l = lower(s);
  if (l == "position") return Fp8ScaleMode::Position;
  if (l == "head") return Fp8ScaleMode::Head;
  if (l == "rotated") return Fp8ScaleMode::Rotated;
  if (l == "channel") return Fp8ScaleMode::Channel;
  fail("unknown FP8 scale mode '" + s + "' (--kv-fp8-scale accepts position, head, rotated, channel)");
}

QuestSelect parse_quest_select(const std::string& s) {
  const std::string l = lower(s);
  if (l == "head") return QuestSelect::Head;
  if (l == "layer") return QuestSelect::Layer;
  fail("unknown page selection '" + s + "' (--kv-page-select accepts head, layer)");
}

const char* quest_select_name(QuestSelect q) { return q == QuestSelect::Layer ? "layer" : "head"; }

KvRetention KvConfig::retention() const {
  if (resident > 0) return KvRetention::Quest;
  if (snapkv_budget > 0) return KvRetention::SnapKV;
  if (h2o_budget > 0) return KvRetention::H2O;
  if (tova_budget > 0) return KvRetention::Tova;
  if (window > 0) return streaming ? KvRetention::Streaming : KvRetention::Window;
  return KvRetention::Full;
}

int64_t KvConfig::capacity() const {
  switch (retention()) {
    case KvRetention::H2O: return h2o_budget;
    case KvRetention::Tova: return tova_budget;
    case KvRetention::SnapKV: return snapkv_budget;
    case KvRetention::Window:
    case KvRetention::Streaming: return window;
    case KvRetention::Full:
    case KvRetention::Quest: return 0;
  }
  return 0;
}

int64_t KvConfig::resident_positions(int64_t context) const {
  return resident > 0 ? std::min(context, resident) : retained(context);
}

int64_t KvConfig::retained(int64_t context) const {
  const int64_t cap = capacity();
  return cap > 0 ? std::min(context, cap) : context;
}

int64_t KvConfig::h2o_recent() const {
  if (h2o_budget <= 0) return 0;
  int64_t r = int64_t(std::floor(recent_fraction * double(h2o_budget)));
  return std::clamp<int64_t>(r, 1, std::max<int64_t>(1, h2o_budget - sinks));
}

int64_t KvConfig::snapkv_recent() const {
  if (snapkv_budget <= 0) return 0;
  const int64_t r = int64_t(std::floor(recent_fraction * double(snapkv_budget)));
  return std::clamp<int64_t>(r, 1, std::max<int64_t>(1, snapkv_budget - sinks));
}

int64_t KvConfig::evict_protected_recent() const {
  switch (retention()) {
    case KvRetention::H2O: return h2o_recent();
    case KvRetention::Tova: {
      // Only the newcomer unless --kv-recent asks for a protected recent share.
      if (!recent_set) return 1;
      const int64_t r = int64_t(std::floor(recent_fraction * double(tova_budget)));
      return std::clamp<int64_t>(r, 1, std::max<int64_t>(1, tova_budget - sinks));
    }
    default: return 0;
  }
}

void KvConfig::validate() const {
  if (window < 0) fail("--kv-window must be positive (got " + std::to_string(window) + ")");
  if (h2o_budget < 0) fail("--kv-h2o must be positive (got " + std::to_string(h2o_budget) + ")");
  if (tova_budget < 0) fail("--kv-tova must be positive (got " + std::to_string(tova_budget) + ")");
  if (h2o_budget > 0 && tova_budget > 0) fail("--kv-h2o and --kv-tova are exclusive (both evict by attention score)");
  if (sinks < 0) fail("--kv-sinks must be 0 or more (got " + std::to_string(sinks) + ")");
  if (!std::isfinite(recent_fraction) || recent_fraction < 0.0 || recent_fraction > 1.0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", recent_fraction);
    fail(std::string("--kv-recent must be a fraction of the h2o budget in [0, 1] (got ") + buf + ")");
  }
  if (fp8_scale_set && dtype != KvDType::FP8)
    fail(std::string("--kv-fp8-scale needs --kv-dtype fp8 (the KV dtype is ") + kv_dtype_name(dtype) + ")");
  if (streaming && window <= 0) fail("streaming retention needs a window size (--kv-streaming W)");
  if (streaming && window_set) fail("--kv-streaming W and --kv-window W are exclusive (streaming is a window with sinks)");
  if (resident < 0) fail("--kv-resident must be positive (got " + std::to_string(resident) + ")");
  if (page < 1) fail("--kv-page must be positive (got " + std::to_string(page) + ")");
  if (page_set && resident <= 0) fail("--kv-page and --kv-page-select need --kv-resident N (the Quest store)");
  if (snapkv_budget < 0) fail("--kv-snapkv must be positive (got " + std::to_string(snapkv_budget) + ")");
  if (snapkv_budget > 0 && (window > 0 || h2o_budget > 0 || tova_budget > 0 || resident > 0))
    fail("--kv-snapkv is exclusive with --kv-window, --kv-streaming, --kv-h2o, --kv-tova and --kv-resident");
  if (snapkv_budget > 0 && snapkv_budget < sinks + 2)
    fail("--kv-snapkv budget " + std::to_string(snapkv_budget) + " is too small: it must be at least sinks + 2 = " +
         std::to_string(sinks + 2));
  if (resident > 0 && (window > 0 || h2o_budget > 0 || tova_budget > 0))
    fail("--kv-resident is exclusive with --kv-window, --kv-streaming, --kv-h2o and --kv-tova (it keeps every position)");
  if (resident > 0 && resident < 2 * page)
    fail("--kv-resident " + std::to_string(resident) + " is too small for pages of " + std::to_string(page) +
         ": it must hold the first and the newest page, at least 2 x --kv-page = " + std::to_string(2 * page));
  // quest with --kv-recent F: the last floor(F x N) positions always read,
  // on whole pages, beside page 0.
  const int64_t quest_recent = resident > 0 && recent_set ? int64_t(std::floor(recent_fraction * double(resident))) : 0;
  if (resident > 0 && quest_recent > 0 && resident < quest_recent + 2 * page)
    fail("--kv-resident " + std::to_string(resident) + " with --kv-recent: the recent " + std::to_string(quest_recent) +
         " positions and two pages of " + std::to_string(page) + " must fit, at least " +
         std::to_string(quest_recent + 2 * page));
  const KvRetention r = retention();
  if (dtype == KvDType::FP8 && fp8_scale == Fp8ScaleMode::Channel && r != KvRetention::Full && r != KvRetention::Quest)
    fail(std::string("--kv-fp8-scale ") + fp8_scale_mode_name(fp8_scale) +
         " needs the full cache or --kv-resident (its per-channel offsets belong to pages of consecutive "
         "positions, which a window, an eviction policy or --kv-snapkv reorders)");
  if (recent_set && r != KvRetention::H2O && r != KvRetention::Tova && r != KvRetention::SnapKV &&
      r != KvRetention::Quest)
    fail("--kv-recent only applies to --kv-h2o, --kv-tova, --kv-snapkv or --kv-resident");
  if (sinks_set && r != KvRetention::H2O && r != KvRetention::Tova && r != KvRetention::Streaming &&
      r != KvRetention::SnapKV)
    fail("--kv-sinks only applies to --kv-h2o, --kv-tova, --kv-snapkv or --kv-streaming (a plain --kv-window keeps "
         "no sinks)");
  if (r == KvRetention::H2O && h2o_budget < sinks + 1)
    fail("--kv-h2o budget " + std::to_string(h2o_budget) + " is too small: it must be at least sinks + 1 = " +
         std::to_string(sinks + 1));
  if (r == KvRetention::Tova && tova_budget < sinks + 1)
    fail("--kv-tova budget " + std::to_string(tova_budget) + " is too small: it must be at least sinks + 1 = " +
         std::to_string(sinks + 1));
  if (r == KvRetention::Streaming && window < sinks + 1)
    fail("--kv-streaming window " + std::to_string(window) + " is too small: it must be at least sinks + 1 = " +
         std::to_string(sinks + 1));
}

std::string KvConfig::describe() const {
  std::string s = std::string("dtype=") + kv_dtype_name(dtype);
  if (dtype == KvDType::FP8) s += std::string(" fp8-scale=") + fp8_scale_mode_name(fp8_scale);
  switch (retention()) {
    case KvRetention::H2O: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g", recent_fraction);
      s += " h2o=" + std::to_string(h2o_budget) + " sinks=" + std::to_string(sinks) + " recent=" +
           std::to_string(h2o_recent()) + " (" + buf + ")";
      break;
    }
    case KvRetention::Tova:
      s += " tova=" + std::to_string(tova_budget) + " sinks=" + std::to_string(sinks);
      if (recent_set) s += " recent=" + std::to_string(evict_protected_recent());
      break;
    case KvRetention::Streaming:
      s += " streaming=" + std::to_string(window) + " sinks=" + std::to_string(sinks);
      break;
    case KvRetention::Window: s += " window=" + std::to_string(window); break;
    case KvRetention::Full: s += " full"; break;
    case KvRetention::SnapKV:
      s += " snapkv=" + std::to_string(snapkv_budget) + " sinks=" + std::to_string(sinks) + " recent=" +
           std::to_string(snapkv_recent());
      break;
    case KvRetention::Quest:
      s += " quest resident=" + std::to_string(resident) + " page=" + std::to_string(page) + " select=" +
           quest_select_name(quest_select);
      if (recent_set) s += " recent=" + std::to_string(int64_t(std::floor(recent_fraction * double(resident))));
      break;
  }
  return s;
}

}  // namespace flashmoe
