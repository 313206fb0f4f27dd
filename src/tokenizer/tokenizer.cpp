#include "tokenizer/tokenizer.h"

#include "tokenizer/json_ids.h"

#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/utf8.h"

namespace flashmoe {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Tokenizer::Impl {
  std::string path;
  NormalForm norm = NormalForm::None;
  PreTokenizer pretok;
  BpeModel bpe;
  AddedTokenMatcher raw_added;   // matched on the input text
  AddedTokenMatcher norm_added;  // normalized=true: matched after normalising
  std::vector<std::string> piece;  // id -> raw bytes
  std::vector<std::string> token;  // id -> vocab spelling
  std::vector<bool> special;
  std::unordered_map<std::string, int32_t> added_by_content;

  void encode_plain(std::string_view text, std::vector<int32_t>& out) const {
    std::vector<std::string_view> words;
    std::deque<std::string> storage;
    pretok.split(text, words, storage);
    for (std::string_view w : words) bpe.encode_word(w, out);
  }
};

namespace {

NormalForm parse_normalizer(const json& n) {
  if (n.is_null()) return NormalForm::None;
  const std::string type = n.value("type", "");
  if (type == "NFC") return NormalForm::NFC;
  if (type == "NFD") return NormalForm::NFD;
  if (type == "NFKC") return NormalForm::NFKC;
  if (type == "NFKD") return NormalForm::NFKD;
  if (type == "Sequence") {
    NormalForm f = NormalForm::None;
    for (const auto& sub : n.at("normalizers")) {
      const NormalForm g = parse_normalizer(sub);
      if (g != NormalForm::None && f != NormalForm::None && g != f)
        fail("tokenizer.json: a sequence of different normalisation forms is not supported");
      if (g != NormalForm::None) f = g;
    }
    return f;
  }
  fail("tokenizer.json: normalizer type '" + type + "' is not supported");
}

json read_json_file(const std::string& file, const std::string& what) {
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot open " + what + ": " + file);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("bad " + what + " (" + file + "): " + e.what());
  }
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  std::string file = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "tokenizer.json").string();
  if (!fs::exists(file, ec)) fail("tokenizer.json not found: " + file);
  return from_json(read_json_file(file, "tokenizer.json"), file);
}

Tokenizer Tokenizer::from_json(const json& j, const std::string& file) {
  auto impl = std::make_unique<Impl>();
  impl->path = file;
  try {
    if (!j.is_object() || !j.contains("model")) fail("bad tokenizer.json (" + file + "): no \"model\"");
    const json& model = j["model"];
    const std::string type = model.value("type", "");
    if (type != "BPE")
      fail("unsupported tokenizer model type '" + type + "' in " + file + " (only byte-level BPE is supported)");
    if (model.value("byte_fallback", false)) fail("tokenizer.json: BPE byte_fallback is not supported");
    const auto nul_or_empty = [&](const char* k) { return !model.contains(k) || model[k].is_null() || model[k] == ""; };
    if (!nul_or_empty("continuing_subword_prefix") || !nul_or_empty("end_of_word_suffix"))
      fail("tokenizer.json: BPE subword prefix/suffix is not supported");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
      fail("tokenizer.json: BPE dropout is not supported");
    impl->norm = parse_normalizer(j.value("normalizer", json()));
    impl->pretok.load(j.value("pre_tokenizer", json()));
    if (!impl->pretok.has_byte_level())
      fail("unsupported tokenizer in " + file + ": pre-tokenizer is not byte-level");
    impl->bpe.load(model);
    impl->piece = impl->bpe.id_bytes();
    impl->token = impl->bpe.id_tokens();

    std::vector<AddedToken> raw, normed;
    for (const auto& a : j.value("added_tokens", json::array())) {
      AddedToken t;
      t.id = json_token_id(a.at("id"), "added_tokens");
      t.content = a.at("content").get<std::string>();
      t.special = a.value("special", false);
      t.lstrip = a.value("lstrip", false);
      t.rstrip = a.value("rstrip", false);
      t.normalized = a.value("normalized", !t.special);
      t.single_word = a.value("single_word", false);
      if (size_t(t.id) >= impl->piece.size()) {
        impl->piece.resize(size_t(t.id) + 1);
        impl->token.resize(size_t(t.id) + 1);
      }
      impl->token[t.id] = t.content;
      // Decoding maps added tokens through the ByteLevel decoder too (HF).
      impl->piece[t.id] = byte_level::decode_token(t.content);
      impl->special.resize(impl->piece.size());
      impl->special[t.id] = t.special;
      impl->added_by_content[t.content] = t.id;
      (t.normalized && impl->norm != NormalForm::None ? normed : raw).push_back(std::move(t));
    }
    impl->special.resize(impl->piece.size());
    impl->raw_added.build(std::move(raw));
    impl->norm_added.build(std::move(normed));
  } catch (const json::exception& e) {
    fail("bad tokenizer.json (" + file + "): " + e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool split_special) const {
  if (const size_t bad = utf8::find_invalid(text); bad != utf8::npos) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(text[bad]));
    fail("invalid UTF-8 in input at byte " + std::to_string(bad) + " (byte " + hex + ")");
  }
  const Impl& m = *impl_;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  std::vector<AddedTokenMatcher::Segment> segs, inner;
  m.raw_added.split(text, split_special, segs);
  for (const auto& s : segs) {
    if (s.id >= 0) {
      ids.push_back(s.id);
      continue;
    }
    const std::string normed = normalize(text.substr(s.begin, s.end - s.begin), m.norm);
    if (m.norm_added.empty()) {
      m.encode_plain(normed, ids);
      continue;
    }
    inner.clear();
    m.norm_added.split(normed, split_special, inner);
    for (const auto& t : inner) {
      if (t.id >= 0) ids.push_back(t.id);
      else m.encode_plain(std::string_view(normed).substr(t.begin, t.end - t.begin), ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || size_t(id) >= impl_->piece.size()) continue;
    if (skip_special && impl_->special[id]) continue;
    bytes += impl_->piece[id];
  }
  return utf8::repair(bytes);
}

const std::string& Tokenizer::token_to_piece(int32_t id) const {
  static const std::string empty;
  return id >= 0 && size_t(id) < impl_->piece.size() ? impl_->piece[id] : empty;
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  static const std::string empty;
  return id >= 0 && size_t(id) < impl_->token.size() ? impl_->token[id] : empty;
}

int32_t Tokenizer::token_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(std::string(token)); it != impl_->added_by_content.end())
    return it->second;
  // Vocab spellings are byte-level unicode; look up by the bytes they mean.
  const std::string bytes = byte_level::decode_token(token);
  const int32_t id = impl_->bpe.id_of_bytes(bytes);
  return id >= 0 && impl_->token[id] == token ? id : -1;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->special.size() && impl_->special[id];
}

size_t Tokenizer::vocab_size() const { return impl_->piece.size(); }

void Tokenizer::spell_missing_ids(size_t model_vocab) {
  Impl& m = *impl_;
  if (model_vocab > m.piece.size()) {
    m.piece.resize(model_vocab);
    m.token.resize(model_vocab);
    m.special.resize(model_vocab, false);
  }
  for (size_t id = 0; id < m.piece.size(); ++id)
    if (m.piece[id].empty()) m.piece[id] = m.token[id] = "<|id_" + std::to_string(id) + "|>";
}

const std::string& Tokenizer::path() const { return impl_->path; }

std::string StreamDecoder::feed(int32_t id) {
  if (skip_special_ && tok_->is_special(id)) return {};
  pending_ += tok_->token_to_piece(id);
  const size_t n = utf8::complete_prefix_length(pending_);
  std::string out = utf8::repair(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8::repair(pending_);
  pending_.clear();
  return out;
}

}  // namespace flashmoe
