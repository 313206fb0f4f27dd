// How one session stores and retains the keys and values of its
// full-attention layers. Fixed when the session is created: a KvCache takes
// everything (element size, slot count) from the KvConfig given to its
// constructor, so storage can never be allocated with a stale format.
#pragma once
#include <cstdint>
#include <string>

namespace flashmoe {

enum class KvDType { F32, BF16, F16, FP8 };
// Rotated: per-head scales over each head's K and V rows after an
// orthonormal Hadamard rotation (outlier channels spread over the head;
// CPU only).
// Channel: `rotated`, with each rotated key stored minus a per-channel
// offset (the mean of the previous page of kFp8OffsetPage positions), so the
// channels a key keeps nearly constant leave only their variation to
// E4M3's 3 mantissa bits, and per-head scales chosen by least squares
// (full retention or --kv-resident; CPU only).
enum class Fp8ScaleMode { Position, Head, Rotated, Channel };
// Quest: every position stored, attention over the top pages per query
// (--kv-resident N --kv-page P).
// SnapKV: the prompt stored whole, compressed to B positions when decoding
// starts (--kv-snapkv B).
enum class KvRetention { Full, Window, Streaming, H2O, Tova, Quest, SnapKV };
// Quest page selection: one choice per KV head (its query heads' bounds, the
// largest wins) or one per layer (all query heads' bounds).
enum class QuestSelect { Head, Layer };

struct KvConfig {
  KvDType dtype = KvDType::F32;
  Fp8ScaleMode fp8_scale = Fp8ScaleMode::Position;
  int64_t window = 0;       // > 0: sliding window of this many positions
  int64_t h2o_budget = 0;   // > 0: heavy-hitter retention with this budget (wins over window)
  int64_t tova_budget = 0;  // > 0: TOVA retention with this budget (exclusive with h2o; wins over window)
  bool streaming = false;   // with window: StreamingLLM (the first `sinks` positions + the last window-sinks)
  int64_t sinks = 4;        // h2o / tova / streaming: first positions always kept
  double recent_fraction = 0.25;  // h2o (tova with --kv-recent): share of the budget kept for the most recent positions
  // > 0: Quest-style query-aware retrieval: every position stays stored (in
  // the KV dtype), grouped in pages of `page` positions with per-channel key
  // bounds; each query attends over at most `resident` positions: the first
  // page, the newest page and the pages with the highest score bound.
  int64_t resident = 0;
  // > 0: SnapKV (Li et al. 2024): the prompt is stored whole; when decoding
  // starts it is cut to this budget: the sinks, the recent share, and the
  // positions the prompt's last kSnapObserved queries attend to most
  // (max-pooled over kSnapPool neighbours); then the kept prompt positions
  // stay and the recent share is a window.
  int64_t snapkv_budget = 0;
  static constexpr int64_t kSnapObserved = 32;
  static constexpr int64_t kSnapPool = 7;
  int64_t page = 16;
  QuestSelect quest_select = QuestSelect::Head;

  // Which options were given explicitly on the command line (so that an
  // option that would be silently ignored is reported instead).
  bool fp8_scale_set = false;     // --kv-fp8-scale (an error without fp8)
  bool sinks_set = false;         // --kv-sinks (an error without h2o / tova / streaming)
  bool recent_set = false;        // --kv-recent (an error without h2o / tova)
  bool window_set = false;        // --kv-window (an error together with --kv-streaming)
  bool page_set = false;          // --kv-page / --kv-page-select (an error without --kv-resident)

  // Throws Error with a clear message for an impossible combination.
  void validate() const;
  std::string describe() const;

  // The policy in effect: h2o / tova win over window / streaming.
  KvRetention retention() const;
  // h2o and tova: a budget of B slots, one position evicted by score when a
  // new one arrives (they share the eviction; only the scores differ).
  bool scored_eviction() const {
    const KvRetention r = retention();
    return r == KvRetention::H2O || r == KvRetention::Tova;
  }
  // Quest: positions one query attends over after `context` tokens: min(context, resident).
  int64_t resident_positions(int64_t context) const;
  // Slots a cache allocates up front (W or B); 0 for `full` and quest (grow).
  int64_t capacity() const;
  // Positions retained after `context` tokens: min(context, W or B); all of them for quest.
  int64_t retained(int64_t context) const;
  // snapkv: the window share of the budget, clamp(floor(recent_fraction * B), 1, B - sinks).
  int64_t snapkv_recent() const;
  // h2o: positions always kept at the recent end, including the newest token:
  // clamp(floor(recent_fraction * B), 1, B - sinks).
  int64_t h2o_recent() const;
  // The recent positions an eviction never takes, the newcomer included:
  // h2o_recent() for h2o; for tova 1 (only the newcomer, which no query has
  // scored yet) or, with --kv-recent F, clamp(floor(F * B), 1, B - sinks);
  // 0 for the other policies.
  int64_t evict_protected_recent() const;
};

const char* kv_dtype_name(KvDType t);
const char* fp8_scale_mode_name(Fp8ScaleMode m);
// fp8 `channel`: positions per page of per-channel offsets.
constexpr int64_t kFp8OffsetPage = 256;
// Bytes per stored element (scales not included).
size_t kv_elem_size(KvDType t);
// "f32" | "bf16" | "f16" | "fp8" (also "fp32", "float32", "bfloat16", "float16",
// "e4m3", "fp8_e4m3"); throws Error naming the accepted values otherwise.
KvDType parse_kv_dtype(const std::string& s);
// "position" | "head" | "rotated" | "channel"; throws Error otherwise.
Fp8ScaleMode parse_fp8_scale_mode(const std::string& s);
// "head" | "layer"; throws Error otherwise.
QuestSelect parse_quest_select(const std::string& s);
const char* quest_select_name(QuestSelect q);

}  // namespace flashmoe
