// The key/value cache of one full-attention layer, and the attention of one
// query token over it. Storage format and retention policy come from the
// KvConfig given to the constructor (and nothing else), so the element size
// and slot count of the storage are fixed before anything is written.
//
// Storage (per slot, K and V each [num_kv_heads][head_dim]):
//   f32 / bf16 / f16: plain (bf16/f16 rounded to nearest even);
//   fp8: OCP E4M3 codes of x / scale with scale = absmax / 240 (1 when the
//   absmax is 0), one f32 scale per slot (`position`, shared by all KV heads)
//   or per slot and KV head (`head`), separately for K and V. `rotated`:
//   as `head`, over each head's K and V rows multiplied by the orthonormal
//   Hadamard matrix H (head_dim a power of two). Attention needs no
//   decoding back: (Hq).(Hk) = q.k, so the query is rotated once per step,
//   and sum_s p_s (H v_s) = H sum_s p_s v_s, so the output is rotated back
//   once (H is its own inverse). E4M3 rounds each element to ~2^-4 of its
//   own size, so a key channel with outliers dominates the score's error;
//   the rotation spreads it over the head. `channel`: as `rotated`, with
//   each rotated key stored minus a per-channel offset z_page (one row per
//   page of kFp8OffsetPage slots: the mean of the previous page's rotated
//   keys, 0 for page 0; full retention and quest only, whose slots never
//   move), decoded as z + scale * value, and the per-head scales of K and V
//   chosen by least squares (fp8::e4m3_mse_scale). Keys of partially
//   RoPE'd heads keep most channels near a constant; less is left to round.
//   Once queries are given (add_query_moments, before the keys they
//   precede), each key's codes and scale minimise e^T H e instead of e^T e,
//   H the second moment of the rotated queries seen so far
//   (kv/qk_rounding.h): the error of q.k, which is what attention reads.
// attend() decodes inline with one kernel instantiation per storage type.
//
// Retention (the model calls append(pos) then attend() for each token, in
// order, prompt included; these are the reference token-by-token semantics):
//   full:      every position is kept; storage grows.
//   window W:  circular buffer of W slots, slot = (tokens appended so far) mod W,
//              i.e. pos mod W when positions run 0,1,2,...; attention reads the
//              min(len, W) valid slots. Nothing is ever copied.
//   streaming: the first `sinks` tokens in slots [0, sinks), the others in a
//              circular buffer over the remaining W - sinks slots. No copying.
//   h2o B:     B slots, kept contiguous and in chronological order.
//     - score accumulation: at the end of every attend(), each retained
//       slot's score += its post-softmax probability summed over all query
//       heads (the newest token included, and sinks / recents too, which
//       simply never get evicted). A new token starts with score 0.
//     - eviction: in append(), when the cache already holds B positions,
//       i.e. when the new token would make B + 1. Of those B + 1 positions
//       the first `sinks` and the last R = h2o_recent() (the new one
//       included) are protected; the middle position with the lowest score
//       is evicted (ties: the oldest), the survivors after it are shifted
//       down one slot (chronological order kept) and the new token is
//       written at slot B - 1. This is exactly "append, then evict the
//       lowest-scoring middle position down to B", done in B slots. So the
//       attend() that follows an append sees the new token, and scores used
//       for an eviction are those accumulated by all attends before it.
//   tova B:    TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"):
//              the h2o layout and eviction, with scores that are not
//              accumulated: at the end of every attend(), each retained
//              slot's score = its post-softmax probability summed over all
//              query heads of that one query (the previous step's scores are
//              overwritten). Protected: the first `sinks` and only the
//              newcomer (R = 1; --kv-recent F: the last floor(F * B) as in
//              h2o), so the position the latest query attended to least is
//              the one that goes when the next token arrives (ties: the
//              oldest). The latest query's own token can go too.
//   quest N, P: Quest-style query-aware retrieval (Tang et al. 2024, "Quest:
//              Query-Aware Sparsity for Efficient Long-Context LLM
//              Inference"). Storage as `full` (every position, in the KV
//              dtype), slot = position order, pages of P consecutive slots
//              (page j: slots [jP, jP + P)), each with the per-channel
//              minimum and maximum of its stored keys per KV head (as
//              decoded: what attention reads, in the stored basis, so the
//              bound is exact for fp8 and `rotated` too). While the cache
//              holds <= N positions attend() is the full attention. Beyond,
//              each attend() scores every page j by the upper bound of q.k
//              over it, U_j(q) = sum_c max(q_c min_c, q_c max_c), takes the
//              largest over the query heads that share the choice (the G
//              heads of one KV head, or all heads with `layer` selection),
//              keeps page 0 (the sinks) and the newest page (partial or not)
//              and then the highest-U pages (ties: the newer) while whole
//              pages fit in N, and runs an exact softmax over the chosen
//              positions only (in slot order). Nothing is evicted.
//   snapkv B:  SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You Are
//              Looking for Before Generation"). While the prompt runs,
//              storage is `full` (so prompts attend as batches) and the
//              caller hands over every prompt query (observe_query; the
//              last kSnapObserved are kept). begin_decode() (the model
//              calls it before the first single-token step) cuts a cache of
//              n > B positions to B: the first `sinks`, the last R =
//              snapkv_recent(), and of the others the B - sinks - R with the
//              highest pooled score (ties: the higher own score, then the
//              newer), in order. score(s) =
//              sum over the observed queries j (each the query of slot t_j,
//              the last slots) and all heads of softmax_{s' <= t_j}(q.k
//              scale)[s]; pooled(s) = max of score over [s - 3, s + 3] (7
//              neighbours, clipped), one choice for all KV heads. Then
//              slots [0, B - R) stay and slots [B - R, B) are a circular
//              window: each new token overwrites the oldest of them. A
//              prompt of <= B positions is kept whole and fills up to B
//              the same way. Chosen per layer (one slot order for the KV
//              heads), as the eviction policies are.
//   RoPE is applied before append(); nothing here ever re-rotates.
#pragma once
#include <cstdint>
#include <vector>

#include "kv/kv_config.h"

namespace flashmoe {

class ThreadPool;

class KvCache {
 public:
  KvCache(int64_t num_kv_heads, int64_t head_dim, const KvConfig& cfg);

  // Stores K and V ([num_kv_heads * head_dim] each, K already normed and
  // rotated) of the token at absolute position `pos` (strictly increasing).
  void append(int64_t pos, const float* k, const float* v);

  // append() of n tokens in order (pos[t], rows t of k and v), the same
  // bits; fp8 `channel` with full retention rounds the keys on the pool
  // (the caller is not inside a parallel_for of it).
  void append_chunk(const int64_t* pos, int64_t n, const float* k, const float* v, ThreadPool& pool);

  // Softmax attention of one query token (q: [num_heads * head_dim], GQA:
  // head h reads kv head h / (num_heads / num_kv_heads)) over every retained
  // position; writes out [num_heads * head_dim]. h2o: then accumulates
  // scores; tova: then sets them to this query's probabilities.
  void attend(const float* q, int64_t num_heads, float scale, float* out);

  // Working memory of one caller of attend_prefix (one per thread).
  struct AttendScratch {
    std::vector<float> probs, krow, vtile, rot;
  };
  // Whether attend_prefix may stand in for the token-by-token walk: under
  // `full` retention nothing is ever evicted or overwritten, so slots
  // [0, s) hold the first s positions in order, and a prompt's keys and
  // values can all be appended before any of its tokens attends.
  bool supports_prefix_attention() const {
    return ret_ == KvRetention::Full || (ret_ == KvRetention::SnapKV && !compressed_);
  }
  // snapkv: whether prompt queries are wanted (observe_query), i.e. not
  // yet compressed.
  bool observes_queries() const { return ret_ == KvRetention::SnapKV && !compressed_; }
  // snapkv: the query ([num_heads * head_dim], as given to attend) of the
  // token most recently appended; the last kSnapObserved are kept.
  void observe_query(const float* q, int64_t num_heads, float scale);
  // fp8 `channel`: whether the keys' roundings want the queries that will
  // read them (add_query_moments before the keys of the same tokens).
  bool wants_query_moments() const { return channel_; }
  // fp8 `channel`: adds the queries of `tokens` tokens ([tokens][num_heads *
  // head_dim], as given to attend) to each KV head's second moment of
  // rotated queries (its G query heads pooled); the keys appended after are
  // rounded against it (kv/qk_rounding.h).
  void add_query_moments(const float* q, int64_t tokens, int64_t num_heads);
  // fp8 `channel`: frees the Cholesky factors of the query moments. They are
  // working memory of the key roundings (recomputed from the moments the
  // first time a key is stored after queries were added, i.e. once per
  // chunk), so the model drops them after each chunk's appends: between
  // calls a sequence holds the moments (a packed triangle per KV head), not
  // their factors too, and kv-calc's per-sequence bytes are what it holds.
  void drop_query_factors();
  // snapkv: the prompt is over; compress (once). No-op for the others.
  void begin_decode();
  bool compressed() const { return compressed_; }
  // attend() over slots [0, slots) only (the query of the token stored in
  // slot slots - 1): the same arithmetic, so the same bits. Const and
  // scratch-explicit, so the tokens of a prompt chunk can attend on several
  // threads at once. Full retention only (it keeps no scores).
  void attend_prefix(const float* q, int64_t num_heads, float scale, float* out, int64_t slots,
                     AttendScratch& scratch) const;

  int64_t size() const { return n_; }  // positions retained
  size_t bytes() const;                // storage allocated (K, V, scales, bookkeeping)
  const KvConfig& config() const { return cfg_; }
  void clear();
  // Takes back the positions appended after the first n (speculative
  // decoding's roll-back): where the cache keeps every position in slot
  // order and nothing derived from later ones (full retention, any dtype
  // but fp8 `channel`, whose page offsets sum the keys). truncatable() says
  // whether it can; elsewhere the caller restores a copy instead.
  bool truncatable() const { return ret_ == KvRetention::Full && !channel_; }
  void truncate(int64_t n);

  // ---- inspection (tests, tools) ----
  int64_t num_kv_heads() const { return nkv_; }
  int64_t head_dim() const { return hd_; }
  // Slots allocated up front (W or B); 0 for `full`.
  int64_t capacity() const { return cap_; }
  // Absolute position held by a valid slot (slot < size()).
  int64_t slot_position(int64_t slot) const { return pos_[size_t(slot)]; }
  // The retained absolute positions in chronological order.
  std::vector<int64_t> positions() const;
  // The dequantised K and V rows ([num_kv_heads * head_dim] each) of a slot.
  void dequantize(int64_t slot, float* k, float* v) const;
  // quest: the slots the last attend() read for KV head kvh (ascending); all
  // of them while the cache holds no more than the resident budget.
  std::vector<int64_t> quest_selected(int64_t kvh) const;
  // h2o: accumulated attention score of a slot; tova: the latest query's
  // probability summed over its heads (0 for the other policies).
  float score(int64_t slot) const { return acc_.empty() ? 0.0f : acc_[size_t(slot)]; }

 private:
  template <KvDType T> void store(int64_t slot, const float* k, const float* v);
  // fp8 `channel` (rotated k, v): store_channel = channel_factor, then
  // channel_center (in slot order), then channel_encode per KV head (any
  // order, any thread: it writes only its slot's head).
  void store_channel(int64_t slot, const float* k, const float* v);
  void channel_factor();
  void channel_center(int64_t slot, const float* k, float* ctr);
  void channel_encode(int64_t slot, int64_t h, const float* ctr, const float* v);
  // sel: nullptr (slots [0, slots)) or nkv_ ascending slot lists, one per KV head.
  template <KvDType T>
  void attend_impl(const float* q, int64_t num_heads, float scale, float* out, int64_t slots,
                   AttendScratch& s, const std::vector<int64_t>* sel = nullptr) const;
  template <KvDType T> void update_page_bounds(int64_t slot);  // quest
  void quest_select_pages(const float* q, int64_t num_heads);  // quest: fills sel_
  void check_heads(int64_t num_heads) const;
  // The decoded K (key) or V row of a slot's KV head: a pointer into the
  // storage (f32) or to buf.
  template <KvDType T> const float* row(bool key, int64_t slot, int64_t kvh, float* buf) const;
  void ensure_slots(int64_t slots);  // full: grow storage to hold `slots`
  void evict_lowest_score();  // h2o / tova
  void snapkv_compress();

  int64_t nkv_, hd_, row_;
  KvConfig cfg_;
  KvRetention ret_;
  size_t el_;          // bytes per element
  int64_t ns_;         // fp8 scales per slot (1 or nkv), 0 otherwise
  int64_t cap_;        // W or B; 0: grows
  int64_t n_ = 0;      // valid slots
  int64_t appended_ = 0;
  int64_t last_pos_ = -1;
  std::vector<uint8_t> k_, v_;   // [slot][kv_head][head_dim] elements of el_ bytes
  std::vector<float> ks_, vs_;   // fp8 scales [slot][ns_] (not `channel`)
  // fp8 `channel`: the scales [slot][kv_head], K's as f24 (3 B each,
  // little-endian), V's as bf16, each chosen among candidates rounded so
  // (fp8_e4m3.h), so storing them loses nothing: 20 B per position on
  // coder-mini instead of 32, which with the query moments below is what
  // keeps the whole cache under 27% of f32 at 2,048 positions.
  std::vector<uint8_t> ks24_;
  std::vector<uint16_t> vs16_;
  std::vector<int64_t> pos_;     // absolute position per slot
  std::vector<float> acc_;       // h2o / tova scores per slot
  static constexpr int64_t kTile = 16;      // value rows decoded per tile in attend()
  bool rotated_ = false;  // fp8 `rotated`: K and V stored as H k, H v per head
  std::vector<float> rot_;  // store(): the rotated K and V rows
  // fp8 `channel`: `rotated`, with each key stored minus a per-channel
  // offset, one row [kv_head][head_dim] per page of kFp8OffsetPage slots
  // (the mean of the previous page's rotated keys; 0 for page 0), and
  // per-head scales chosen by least squares (fp8::e4m3_mse_scale) for V,
  // and for K until a query is seen;
  bool channel_ = false;
  std::vector<float> kz_;    // [page][row_] key offsets
  std::vector<float> kacc_;  // [row_]: sum of the current page's rotated keys
  std::vector<float> ctr_;   // store(): the centered key row
  // after that, K's codes and scale are chosen against the second moment
  // of the queries seen so far (kv/qk_rounding.h).
  // [kv_head][packed_triangle(head_dim)]: sum of rotated q q^T, the lower
  // triangle only (symmetric): 8,320 B per KV head at head_dim 64 instead
  // of 16,384. f32, not 16-bit: it is a running sum, and one token's q q^T
  // is ~1/n of it, below bf16's and f16's precision after a few hundred.
  std::vector<float> qmom_;
  // Per KV head: the damped Cholesky factor of qmom_ (d x d floats; empty:
  // no query yet). Working memory: computed when the first key after new
  // queries is stored, freed by drop_query_factors().
  std::vector<std::vector<float>> qchol_;
  bool qchol_valid_ = false;  // qchol_ is the factor of the current qmom_
  AttendScratch scratch_;   // attend()'s
  // quest: [page][kv_head][head_dim] key minimum and maximum per channel.
  std::vector<float> kmin_, kmax_;
  std::vector<std::vector<int64_t>> sel_;  // slots the last attend() read, per KV head
  bool sel_all_ = true;                    // the last attend() read every slot
  std::vector<float> page_bound_;          // [page] bound of the current choice
  std::vector<int64_t> page_order_;
  // snapkv
  bool compressed_ = false;
  std::vector<float> obs_q_;   // [kSnapObserved][obs_heads_ * head_dim], ring
  int64_t obs_n_ = 0;          // queries observed (the last min(obs_n_, kSnapObserved) kept)
  int64_t obs_heads_ = 0;
  float obs_scale_ = 1.0f;
  int64_t obs_last_slot_ = -1; // the slot of the last observed query's token
  int64_t ring_ = 0;           // window slots written since compression
};

}  // namespace flashmoe
