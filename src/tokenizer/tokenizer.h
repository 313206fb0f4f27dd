// A Hugging Face tokenizer.json (byte-level BPE, as used by Qwen2/3/3.5)
// reproduced exactly: added tokens -> normaliser -> pre-tokeniser -> BPE on
// encode; id -> byte-level pieces -> lossy UTF-8 on decode.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace flashmoe {

class Tokenizer {
 public:
  // `path` is a tokenizer.json file or a directory holding one. Throws
  // flashmoe::Error for a missing/unreadable/unsupported file.
  static Tokenizer load(const std::string& path);
  // The same from a tokenizer.json document already in memory (a GGUF's
  // tokenizer, tokenizer/gguf_tokenizer.h); `source` names it in errors.
  static Tokenizer from_json(const nlohmann::json& j, const std::string& source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Text -> ids, like HF encode(text, add_special_tokens=False). Added tokens
  // in the text are recognised (with split_special=true, ones marked special
  // are encoded as plain text instead). Throws Error for invalid UTF-8,
  // naming the byte offset.
  std::vector<int32_t> encode(std::string_view text, bool split_special = false) const;

  // Ids -> text. Ids unknown to the tokenizer are skipped (as HF does);
  // invalid UTF-8 from partial byte tokens becomes U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // The raw bytes id stands for (may be a partial UTF-8 character); empty for
  // unknown ids.
  const std::string& token_to_piece(int32_t id) const;
  // The token's spelling in the vocab ("Ġthe", "<|im_end|>"); empty if unknown.
  const std::string& id_to_token(int32_t id) const;
  // Id of a vocab/added token by its spelling, or -1.
  int32_t token_id(std::string_view token) const;
  bool is_special(int32_t id) const;
  // Highest id + 1, counting added tokens (what embeddings must cover).
  size_t vocab_size() const;

  // For a model whose vocabulary is larger than this tokenizer's (a
  // synthetic model served with a real tokenizer, `serve --synthetic`):
  // every id below `model_vocab` that the tokenizer does not have decodes
  // to the text "<|id_N|>" (N the id) instead of nothing, so each generated
  // token shows; encode never produces these ids (typing "<|id_N|>" encodes
  // the text), and vocab_size() becomes model_vocab.
  void spell_missing_ids(size_t model_vocab);

  const std::string& path() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Feeds ids one at a time and returns only text that is complete UTF-8, so a
// character split over several byte tokens is emitted once, whole.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false)
      : tok_(&tok), skip_special_(skip_special) {}
  std::string feed(int32_t id);
  // Returns what is still held back (repaired with U+FFFD) and resets.
  std::string flush();

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace flashmoe
