// The byte-level BPE model of an HF tokenizer.json: vocab, merges by rank,
// and the merge loop applied to one pre-tokenized word. Words are raw bytes;
// the vocab is stored keyed by those bytes so no byte<->unicode translation
// happens on the hot path.
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace flashmoe {

class BpeModel {
 public:
  // `model` is tokenizer.json's "model" object (type BPE, checked by caller).
  void load(const nlohmann::json& model);

  // Appends the ids of one word (raw bytes). Cached: words repeat a lot.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  // Vocab lookup by raw bytes; -1 when absent.
  int32_t id_of_bytes(std::string_view bytes) const;

  // Raw bytes of every id in the vocab (empty string for holes).
  const std::vector<std::string>& id_bytes() const { return id_bytes_; }
  // The vocab's own spelling (byte-level unicode, e.g. "Ġthe").
  const std::vector<std::string>& id_tokens() const { return id_tokens_; }

 private:
  struct Merge {
    int32_t rank, new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (uint64_t(uint32_t(a)) << 32) | uint32_t(b);
  }
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  StringMap bytes_to_id_;
  std::vector<std::string> id_bytes_, id_tokens_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::array<int32_t, 256> byte_id_{};
  bool ignore_merges_ = false;

  // Word -> ids. Bounded (cleared when full) so adversarial input cannot grow
  // it without limit; guarded so one Tokenizer can serve several threads.
  using Cache = std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>;
  static constexpr size_t kCacheMaxEntries = 200000;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable Cache cache_;
  mutable std::mutex cache_mu_;
};

}  // namespace flashmoe
