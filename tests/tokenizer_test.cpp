// Tokenizer exactness against HF tokenizers reference outputs (the jsonl
// fixtures were produced with add_special_tokens=False), plus decode and
// streaming-detokeniser properties.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace tokenizer_test {

using namespace flashmoe;
using json = nlohmann::json;

namespace {

const std::string kSrc = FLASHMOE_SOURCE_DIR;

std::string tokenizer_path(const std::string& name) {
  return name == "qwen3" ? kSrc + "/tests/fixtures/tokenizers/qwen3" : kSrc + "/models/coder-mini";
}

// Loading the 11 MB qwen3 file takes a moment; share one instance per name.
const Tokenizer& tok(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, Tokenizer::load(tokenizer_path(name))).first;
  return it->second;
}

std::vector<json> read_jsonl(const std::string& file) {
  std::ifstream in(file);
  EXPECT_TRUE(in) << file;
  std::vector<json> rows;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

std::vector<json> dev_rows(const std::string& name) {
  return read_jsonl(kSrc + "/tests/fixtures/tokenizers/" + name + ".tokenize_dev.jsonl");
}

}  // namespace

class TokenizeDev : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizeDev, ExactIdsOnEveryLine) {
  const auto rows = dev_rows(GetParam());
  ASSERT_GE(rows.size(), 100u);
  int mismatches = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string text = rows[i]["text"];
    const auto want = rows[i]["ids"].get<std::vector<int32_t>>();
    const auto got = tok(GetParam()).encode(text);
    if (got != want) {
      ++mismatches;
      ADD_FAILURE() << "line " << i + 1 << ": " << json(text).dump() << "\n  want " << json(want).dump()
                    << "\n  got  " << json(got).dump();
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_P(TokenizeDev, DecodeRoundTripIsNfcAndMatchesReference) {
  for (const auto& row : dev_rows(GetParam())) {
    const std::string text = row["text"];
    const auto ids = tok(GetParam()).encode(text);
    const std::string dec = tok(GetParam()).decode(ids);
    EXPECT_EQ(dec, normalize(text, NormalForm::NFC)) << json(text).dump();
    EXPECT_EQ(dec, row["decoded"].get<std::string>()) << json(text).dump();
    // Decoding the reference ids gives the reference text too.
    EXPECT_EQ(tok(GetParam()).decode(row["ids"].get<std::vector<int32_t>>()), row["decoded"].get<std::string>());
  }
}

TEST_P(TokenizeDev, StreamingDecoderEqualsBatchDecodeAndNeverSplitsCharacters) {
  for (const auto& row : dev_rows(GetParam())) {
    const auto ids = row["ids"].get<std::vector<int32_t>>();
    StreamDecoder sd(tok(GetParam()));
    std::string all;
    for (int32_t id : ids) {
      const std::string part = sd.feed(id);
      EXPECT_EQ(utf8::find_invalid(part), utf8::npos) << "partial UTF-8 emitted";
      EXPECT_EQ(part.find("\xEF\xBF\xBD"), std::string::npos) << "replacement char emitted mid-stream";
      all += part;
    }
    all += sd.flush();
    EXPECT_EQ(all, row["decoded"].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizeDev, ::testing::Values("qwen3", "coder-mini"),
                         [](const auto& info) { return info.param == "qwen3" ? "qwen3" : "coder_mini"; });

TEST(Tokenizer, MultiByteCharacterSplitAcrossTokensIsHeldBack) {
  const Tokenizer& t = tok("qwen3");
  // Byte tokens of "é" (C3 A9) and "👍" (F0 9F 91 8D): feed one byte-token at a time.
  const std::string text = "\xC3\xA9\xF0\x9F\x91\x8D";
  std::vector<int32_t> byte_ids;
  for (unsigned char b : text) {
    const std::string one(1, char(b));
    int32_t id = -1;
    for (int32_t i = 0; i < int32_t(t.vocab_size()); ++i)
      if (t.token_to_piece(i) == one) { id = i; break; }
    ASSERT_GE(id, 0);
    byte_ids.push_back(id);
  }
  StreamDecoder sd(t);
  EXPECT_EQ(sd.feed(byte_ids[0]), "");
  EXPECT_EQ(sd.feed(byte_ids[1]), "\xC3\xA9");
  EXPECT_EQ(sd.feed(byte_ids[2]), "");
  EXPECT_EQ(sd.feed(byte_ids[3]), "");
  EXPECT_EQ(sd.feed(byte_ids[4]), "");
  EXPECT_EQ(sd.feed(byte_ids[5]), "\xF0\x9F\x91\x8D");
  EXPECT_EQ(sd.flush(), "");
  // A dangling lead byte at the end is flushed as U+FFFD, like batch decode.
  EXPECT_EQ(sd.feed(byte_ids[2]), "");
  EXPECT_EQ(sd.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(t.decode(std::vector<int32_t>{byte_ids[2]}), "\xEF\xBF\xBD");
  // The real encoding of an emoji-heavy string contains multi-token characters.
  const auto ids = t.encode("\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD");
  StreamDecoder sd2(t);
  std::string got;
  for (int32_t id : ids) {
    std::string p = sd2.feed(id);
    EXPECT_EQ(utf8::find_invalid(p), utf8::npos);
    got += p;
  }
  EXPECT_EQ(got + sd2.flush(), "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD");
}

TEST(Tokenizer, LookupsAndSpecialTokens) {
  const Tokenizer& t = tok("qwen3");
  EXPECT_EQ(t.token_id("<|im_end|>"), 151645);
  EXPECT_EQ(t.token_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.token_id("<think>"), 151667);
  EXPECT_EQ(t.token_id("Hello"), 9707);
  EXPECT_EQ(t.token_id("Ġworld"), 1879);
  EXPECT_EQ(t.token_id("no-such-token-xyz"), -1);
  EXPECT_EQ(t.id_to_token(1879), "Ġworld");
  EXPECT_EQ(t.token_to_piece(1879), " world");
  EXPECT_EQ(t.id_to_token(151645), "<|im_end|>");
  EXPECT_TRUE(t.is_special(151645));
  EXPECT_FALSE(t.is_special(151667));  // <think> is an added but non-special token
  EXPECT_EQ(t.vocab_size(), 151669u);
  EXPECT_EQ(tok("coder-mini").vocab_size(), 4096u);
  EXPECT_EQ(tok("coder-mini").token_id("<|im_end|>"), 4093);
  const std::vector<int32_t> ids = {151644, 9707, 151645};
  EXPECT_EQ(t.decode(ids), "<|im_start|>Hello<|im_end|>");
  EXPECT_EQ(t.decode(ids, /*skip_special=*/true), "Hello");
  // split_special: special tokens become plain text, non-special added ones stay.
  const auto plain = t.encode("<|im_end|><think>", /*split_special=*/true);
  EXPECT_GT(plain.size(), 2u);
  EXPECT_EQ(plain.back(), 151667);
  EXPECT_EQ(t.decode(plain), "<|im_end|><think>");
}

// serve --synthetic: a model vocabulary past the tokenizer's (the 35B
// synthetic's 248,320 ids against Qwen3's 151,669) spells the ids the
// tokenizer lacks as "<|id_N|>"; the tokenizer's own ids and encoding are
// unchanged.
TEST(Tokenizer, MissingIdsOfALargerModelVocabularyAreSpelledOut) {
  Tokenizer t = Tokenizer::load(tokenizer_path("coder-mini"));
  const std::vector<int32_t> before = t.encode("def f(x): return <|id_4100|>");
  EXPECT_EQ(t.decode(std::vector<int32_t>{4100}), "");  // as HF: unknown ids are skipped
  t.spell_missing_ids(4200);
  EXPECT_EQ(t.vocab_size(), 4200u);
  EXPECT_EQ(t.decode(std::vector<int32_t>{4100, 4199}), "<|id_4100|><|id_4199|>");
  EXPECT_EQ(t.token_to_piece(4096), "<|id_4096|>");
  EXPECT_FALSE(t.is_special(4100));
  EXPECT_EQ(t.decode(std::vector<int32_t>{4200}), "");  // past the model's vocabulary: still nothing
  EXPECT_EQ(t.token_to_piece(4093), "<|im_end|>");
  EXPECT_EQ(t.encode("def f(x): return <|id_4100|>"), before);
  StreamDecoder d(t, /*skip_special=*/true);
  EXPECT_EQ(d.feed(4150), "<|id_4150|>");
}

TEST(Tokenizer, InvalidUtf8IsRejectedWithPosition) {
  try {
    tok("qwen3").encode("abc\xFF" "def");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid UTF-8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("byte 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tok("qwen3").encode("\xED\xA0\x80"), Error);  // encoded surrogate
  EXPECT_THROW(tok("qwen3").encode("\xC3"), Error);          // truncated
}

TEST(Tokenizer, LoadErrorsAreClear) {
  try {
    Tokenizer::load("/nonexistent/dir/tokenizer.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not found"), std::string::npos);
  }
  const std::string dir = ::testing::TempDir();
  const std::string bad = dir + "/bad_tokenizer.json";
  std::ofstream(bad) << "{ not json";
  EXPECT_THROW(Tokenizer::load(bad), Error);
  const std::string wp = dir + "/wordpiece_tokenizer.json";
  std::ofstream(wp) << R"({"model": {"type": "WordPiece", "vocab": {}}})";
  try {
    Tokenizer::load(wp);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unsupported tokenizer model type 'WordPiece'"), std::string::npos)
        << e.what();
  }
}

TEST(Utf8, RepairUsesMaximalSubparts) {
  // Same results as Rust's String::from_utf8_lossy.
  EXPECT_EQ(utf8::repair("a\xF0\x9F\x91" "b"), "a\xEF\xBF\xBD" "b");  // one U+FFFD for a truncated 4-byte
  EXPECT_EQ(utf8::repair("\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8::repair("\xE0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");    // E0 80 is not a valid prefix
  EXPECT_EQ(utf8::complete_prefix_length("ab\xE2\x82"), 2u);
  EXPECT_EQ(utf8::complete_prefix_length("ab\xFF"), 3u);
}

}  // namespace tokenizer_test
