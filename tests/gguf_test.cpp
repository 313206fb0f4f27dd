// GGUF models: the reader's checks on bad files, and the forward pass on
// GGUFs made by llama.cpp's converter / quantizer against llama.cpp's own
// logits for them (tests/fixtures/gguf/README.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/argmax.h"
#include "core/error.h"
#include "engine/session.h"
#include "format/gguf.h"
#include "format/gguf_config.h"
#include "runtime/cuda_backend.h"
#include "test_util.h"
#include "tokenizer/gguf_tokenizer.h"

namespace gguf_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

std::string gguf_fixture(const std::string& name) { return source_path("tests/fixtures/gguf/" + name); }

// A GGUF file built byte by byte, so each test can break one thing.
struct GgufBytes {
  std::string b;
  void u32(uint32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); }
  void u64(uint64_t v) { b.append(reinterpret_cast<const char*>(&v), 8); }
  void str(const std::string& s) {
    u64(s.size());
    b += s;
  }
  void header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    b = "GGUF";
    u32(version);
    u64(n_tensors);
    u64(n_kv);
  }
  void kv_string(const std::string& k, const std::string& v) {
    str(k);
    u32(8);
    str(v);
  }
  void kv_u32(const std::string& k, uint32_t v) {
    str(k);
    u32(4);
    u32(v);
  }
  void kv_u32_array(const std::string& k, const std::vector<uint32_t>& v) {
    str(k);
    u32(9);
    u32(4);
    u64(v.size());
    for (uint32_t x : v) u32(x);
  }
  void tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    str(name);
    u32(uint32_t(ne.size()));
    for (uint64_t d : ne) u64(d);
    u32(type);
    u64(offset);
  }
  void pad() {
    while (b.size() % 32) b += '\0';
  }
};

// One F32 tensor [4, 2] and a string, an int and an int-array key.
GgufBytes small_file() {
  GgufBytes g;
  g.header(3, 1, 3);
  g.kv_string("general.architecture", "qwen35");
  g.kv_u32("qwen35.block_count", 2);
  g.kv_u32_array("list", {1, 2, 3});
  g.tensor("t", {4, 2}, 0, 0);
  g.pad();
  g.b.append(32, '\0');
  return g;
}

std::string error_of(const std::string& bytes) {
  TempDir d;
  const std::string p = d.path + "/m.gguf";
  write_file(p, bytes);
  try {
    GgufModel g(p);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GgufReader, ReadsMetadataAndTensors) {
  TempDir d;
  const std::string p = d.path + "/m.gguf";
  write_file(p, small_file().b);
  GgufModel g(p);
  EXPECT_EQ(g.get_string("general.architecture"), "qwen35");
  EXPECT_EQ(g.get_int("qwen35.block_count"), 2);
  EXPECT_EQ(g.get("list").ints, (std::vector<int64_t>{1, 2, 3}));
  ASSERT_TRUE(g.tensor("t"));
  EXPECT_EQ(g.tensor("t")->ne, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(g.tensor("t")->nbytes, 32u);
}

TEST(GgufReader, BadFilesGiveOneClearError) {
  GgufBytes g = small_file();
  std::string bytes = g.b;
  EXPECT_NE(error_of("GGUX" + bytes.substr(4)).find("not a GGUF file"), std::string::npos);
  std::string v2 = bytes;
  v2[4] = 2;
  EXPECT_NE(error_of(v2).find("GGUF version 2 is not supported"), std::string::npos);
  // Truncated inside the metadata, and inside the tensor data.
  EXPECT_NE(error_of(bytes.substr(0, 40)).find("truncated"), std::string::npos);
  EXPECT_NE(error_of(bytes.substr(0, bytes.size() - 1)).find("lies outside the file"), std::string::npos);
  // An unknown tensor type.
  GgufBytes u;
  u.header(3, 1, 0);
  u.tensor("w", {32}, 77, 0);
  u.pad();
  u.b.append(64, '\0');
  EXPECT_NE(error_of(u.b).find("tensor 'w': unknown tensor type 77"), std::string::npos);
  // Data offset beyond the file.
  GgufBytes o;
  o.header(3, 1, 0);
  o.tensor("w", {8}, 0, 4096);
  o.pad();
  o.b.append(32, '\0');
  EXPECT_NE(error_of(o.b).find("tensor 'w': data [4096, 4128) lies outside the file"), std::string::npos);
  // Rows that are not whole blocks.
  GgufBytes q;
  q.header(3, 1, 0);
  q.tensor("w", {33}, 8, 0);
  q.pad();
  q.b.append(64, '\0');
  EXPECT_NE(error_of(q.b).find("not a whole number of Q8_0 blocks"), std::string::npos);
  // An array count larger than the file.
  GgufBytes a;
  a.header(3, 0, 1);
  a.str("k");
  a.u32(9);
  a.u32(4);
  a.u64(uint64_t(1) << 40);
  EXPECT_NE(error_of(a.b).find("truncated"), std::string::npos);
}

TEST(GgufReader, MissingMetadataAndUnknownArchAreNamed) {
  TempDir d;
  const std::string p = d.path + "/m.gguf";
  write_file(p, small_file().b);
  GgufModel g(p);
  try {
    gguf_model_config(g);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GGUF metadata has no 'qwen35.embedding_length'"), std::string::npos)
        << e.what();
  }
  GgufBytes x;
  x.header(3, 0, 1);
  x.kv_string("general.architecture", "llama");
  write_file(p, x.b);
  GgufModel g2(p);
  EXPECT_THROW(
      {
        try {
          gguf_model_config(g2);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("architecture 'llama' is not supported"), std::string::npos);
          throw;
        }
      },
      Error);
}

// A real file with one tensor's shape edited: the loader names the tensor,
// its shape and the one the metadata implies.
TEST(GgufReader, WrongTensorShapeIsNamed) {
  std::string bytes = read_file(gguf_fixture("tiny-qwen35-dense-q8_0.gguf"));
  const std::string name = "blk.0.attn_norm.weight";
  const size_t at = bytes.find(name);
  ASSERT_NE(at, std::string::npos);
  const size_t dim0 = at + name.size() + 4;  // after the name: u32 dimension count, then u64 dims
  uint64_t d;
  std::memcpy(&d, bytes.data() + dim0, 8);
  ASSERT_EQ(d, 128u);
  d = 64;
  std::memcpy(bytes.data() + dim0, &d, 8);
  TempDir dir;
  write_file(dir.path + "/m.gguf", bytes);
  try {
    QwenModel::load(dir.path + "/m.gguf");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'blk.0.attn_norm.weight' has shape {64}, expected {128}"),
              std::string::npos)
        << e.what();
  }
}

TEST(GgufReader, SplitFilesAreJoined) {
  TempDir d;
  for (int part = 1; part <= 2; ++part) {
    GgufBytes g;
    g.header(3, 1, 2);
    g.str("split.count");  // a u16, as gguf-split writes it
    g.u32(2);
    g.b += std::string("\x02\x00", 2);
    g.kv_u32("split.no", uint32_t(part - 1));
    g.tensor("t" + std::to_string(part), {8}, 0, 0);
    g.pad();
    g.b.append(32, '\0');
    write_file(d.path + "/m-0000" + std::to_string(part) + "-of-00002.gguf", g.b);
  }
  GgufModel g(d.path + "/m-00001-of-00002.gguf");
  EXPECT_TRUE(g.has_tensor("t1"));
  EXPECT_TRUE(g.has_tensor("t2"));
  try {
    GgufModel g2(d.path + "/m-00002-of-00002.gguf");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("give the first part"), std::string::npos) << e.what();
  }
}

// coder-mini-metadata.gguf: the metadata of llama.cpp's coder-mini-q8_0.gguf
// (its converter's tokenizer.ggml.* and chat template), no tensors.
TEST(GgufTokenizer, SameIdsAndRendersAsTheHfFiles) {
  const GgufModel g(gguf_fixture("coder-mini-metadata.gguf"));
  const Tokenizer tok = gguf_tokenizer(g);
  std::ifstream in(source_path("tests/fixtures/tokenizers/coder-mini.tokenize_dev.jsonl"));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const nlohmann::json row = nlohmann::json::parse(line);
    const std::string text = row["text"].get<std::string>();
    EXPECT_EQ(tok.encode(text), row["ids"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(tok.decode(row["ids"].get<std::vector<int32_t>>()), row["decoded"].get<std::string>());
    ++n;
  }
  EXPECT_EQ(n, 101);
  EXPECT_TRUE(tok.is_special(tok.token_id("<|im_end|>")));

  const std::optional<ChatTemplate> tmpl = gguf_chat_template(g);
  ASSERT_TRUE(tmpl);
  EXPECT_EQ(tmpl->eos_token(), "<|endoftext|>");
  std::ifstream chats(source_path("tests/fixtures/tokenizers/coder-mini.chat_dev.jsonl"));
  n = 0;
  while (std::getline(chats, line)) {
    const nlohmann::ordered_json row = nlohmann::ordered_json::parse(line);
    const auto& th = row["enable_thinking"];
    EXPECT_EQ(tmpl->render(row["messages"], row["add_generation_prompt"].get<bool>(),
                           th.is_null() ? std::nullopt : std::optional<bool>(th.get<bool>())),
              row["rendered"].get<std::string>());
    ++n;
  }
  EXPECT_EQ(n, 12);
}

TEST(GgufCli, ModelCommandsTakeAGgufFile) {
  const std::string m = gguf_fixture("tiny-qwen35moe-text-q4_k_m.gguf");
  CmdResult r = run_flashmoe("generate -m " + m + " --device cpu -t 1 --ids 1,2,3 -n 4 --greedy --print-ids");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), ' '), 3) << r.out;
  r = run_flashmoe("kv-calc -m " + m + " --context 4096");
  EXPECT_EQ(r.code, 0) << r.err;
  r = run_flashmoe("tokenize -m " + gguf_fixture("coder-mini-metadata.gguf"), "\"Hello, world!\"\n");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "[39,441,308,11,323,263,1995,0]\n");
  // A GGUF with no tensors: one clear error naming the file and the tensor.
  r = run_flashmoe("generate -m " + gguf_fixture("coder-mini-metadata.gguf") + " --device cpu --ids 1 -n 1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("coder-mini-metadata.gguf: GGUF has no 2-D tensor 'token_embd.weight'"), std::string::npos)
      << r.err;
  r = run_flashmoe("generate -m /nonexistent/x.gguf --ids 1 -n 1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("model file not found: /nonexistent/x.gguf"), std::string::npos) << r.err;
}

// The CUDA backend has no GGUF block kernels and pairs value and key heads
// in HF's grouped order: both keep a GGUF model off it, with the reason
// (checked on the host; no GPU needed).
// GGUF block types and Qwen3.5's tiled value heads have CUDA kernels: no
// obstacle keeps these files off the GPU (the logits are compared with the
// CPU's in cuda_gguf_test.cpp, on a GPU).
TEST(GgufDevice, CudaTakesGgufFiles) {
  for (const char* f : {"tiny-qwen35moe-text-q4_k_m.gguf", "tiny-qwen35-dense-bf16.gguf", "tiny-qwen3next-q4_k_m.gguf"}) {
    auto q = QwenModel::load(gguf_fixture(f));
    const Obstacle o = cuda_weight_obstacle(*q);
    EXPECT_EQ(o.code, ObstacleCode::None) << f << ": " << o.message;
  }
}

// llama.cpp's logits for the first positions of the fixture's ids_long.
struct LlamaRef {
  std::vector<int32_t> ids;
  std::vector<float> logits;
};

LlamaRef llama_ref(const std::string& file) {
  RefTensor ids = load_ref(file, "ids"), logits = load_ref(file, "logits");
  return {ids.ids, logits.f32};
}

class GgufLogits : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

// Quantised files against llama.cpp on the same weights dequantised to F32
// (F32 activations, as flashmoe computes); BF16 against llama.cpp on the
// BF16 file itself, whose matmuls round the activations to BF16 too, so the
// bound there is looser.
TEST_P(GgufLogits, MatchLlamaCpp) {
  const std::string name = GetParam().first, ref_kind = GetParam().second;
  auto model = QwenModel::load(gguf_fixture(name + ".gguf"));
  const LlamaRef ref = llama_ref(gguf_fixture(name + ".gguf." + ref_kind + ".safetensors"));
  ThreadPool pool(2);
  Session s(cpu_of(*model), KvConfig{}, pool);
  std::vector<float> got = s.feed_all(ref.ids);
  ASSERT_EQ(got.size(), ref.logits.size());
  const int64_t V = model->config().vocab_size;
  const float d = max_abs_diff(got.data(), ref.logits.data(), got.size());
  const double kl = mean_kl(ref.logits, got, V);
  if (ref_kind == "llama-logits-deq-f32") {
    EXPECT_LE(d, 1e-4f);
    EXPECT_LE(kl, 1e-9);
  } else {
    // llama.cpp's own run: its BF16 matmuls round the activations to BF16.
    EXPECT_LE(d, 0.3f);
    EXPECT_LE(kl, 3e-4);
  }
  std::printf("%s: max|dlogit| %.3g, mean KL %.3g\n", name.c_str(), d, kl);
  // Token by token: the decode products (Q4_K / Q6_K / Q8_0 / Q5_0 rows
  // against activations rounded to two int16 codes, core/block_quant_i16.h)
  // stay within the same bounds (one int16 code alone gave 1.7e-3 to 0.73).
  // (The first 16 positions under the sanitizers.)
  const size_t steps = sanitizer_build() ? std::min<size_t>(16, ref.ids.size()) : ref.ids.size();
  Session one(cpu_of(*model), KvConfig{}, pool);
  std::vector<float> dec;
  for (size_t i = 0; i < steps; ++i) {
    const std::vector<float>& l = one.feed({ref.ids[i]});
    dec.insert(dec.end(), l.begin(), l.end());
  }
  const std::vector<float> ref_steps(ref.logits.begin(), ref.logits.begin() + std::ptrdiff_t(dec.size()));
  const float dd = max_abs_diff(dec.data(), ref_steps.data(), dec.size());
  const double dkl = mean_kl(ref_steps, dec, V);
  std::printf("%s token by token: max|dlogit| %.3g, mean KL %.3g\n", name.c_str(), dd, dkl);
  if (ref_kind == "llama-logits-deq-f32") {
    EXPECT_LE(dd, 1e-4f);
    EXPECT_LE(dkl, 1e-9);
  } else {
    EXPECT_LE(dd, 0.3f);
    EXPECT_LE(dkl, 3e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GgufLogits,
                         ::testing::Values(std::make_pair("tiny-qwen35-dense-q8_0", "llama-logits-deq-f32"),
                                           std::make_pair("tiny-qwen35moe-text-q4_k_m", "llama-logits-deq-f32"),
                                           std::make_pair("tiny-qwen3next-q4_k_m", "llama-logits-deq-f32"),
                                           std::make_pair("tiny-qwen35-dense-bf16", "llama-logits")));

// The BF16 file's greedy continuation (no activation rounding changes an
// argmax there) equals llama.cpp's.
TEST(GgufGreedy, Bf16MatchesLlamaCpp) {
  auto model = QwenModel::load(gguf_fixture("tiny-qwen35-dense-bf16.gguf"));
  const std::string ref = gguf_fixture("tiny-qwen35-dense-bf16.gguf.llama-logits.safetensors");
  RefTensor prompt = load_ref(ref, "greedy_prompt"), greedy = load_ref(ref, "greedy");
  ThreadPool pool(2);
  Session s(cpu_of(*model), KvConfig{}, pool);
  const int64_t V = model->config().vocab_size;
  std::vector<int32_t> out;
  const std::vector<float>* logits = &s.feed(prompt.ids);
  for (size_t i = 0; i < greedy.ids.size(); ++i) {
    out.push_back(argmax(logits->data(), V));
    logits = &s.feed({out.back()});
  }
  EXPECT_EQ(out, greedy.ids);
}

}  // namespace

}  // namespace gguf_test
