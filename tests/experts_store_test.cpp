// Expert stores: the cache's eviction policies, and every way a packed model
// on disk can be damaged must end in an Error naming the file and expert.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "experts/expert_cache.h"
#include "experts/manifest.h"
#include "experts_test_util.h"
#include "model/pack_model.h"

namespace experts_store_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

const char* kTiny = "tests/fixtures/tiny-qwen35moe";

struct Packed {
  TempDir tmp;
  std::string dir = tmp / "packed";
  std::vector<int32_t> ids = reference_ids(source_path(std::string(kTiny) + "/reference.safetensors"), "ids_long", 32);
  Packed() { pack_model(source_path(std::string(kTiny) + "/model"), dir, PackOptions{}); }
  nlohmann::json manifest() const { return nlohmann::json::parse(read_text_file(dir + "/" + kManifestName)); }
  void write_manifest(const nlohmann::json& j) const {
    FILE* f = std::fopen((dir + "/" + kManifestName).c_str(), "w");
    std::fputs(j.dump().c_str(), f);
    std::fclose(f);
  }
};

// Runs the model and returns the Error's message ("" if none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const flashmoe::Error& e) {
    return e.what();
  }
  return "";
}

ExpertOptions streaming(int64_t cache_mb = 0) {
  ExpertOptions o;
  o.store = "stream";
  o.cache_mb = cache_mb;
  return o;
}

}  // namespace

TEST(ExpertsStore, LruEvictsLeastRecentlyUsed) {
  ExpertCache c(300, CachePolicy::Lru);
  auto buf = std::make_shared<int>(0);
  c.put(1, buf, 100);
  c.put(2, buf, 100);
  c.put(3, buf, 100);
  EXPECT_TRUE(c.get(1));  // 1 is now the most recent
  c.put(4, buf, 100);     // evicts 2
  EXPECT_FALSE(c.get(2));
  EXPECT_TRUE(c.get(1) && c.get(3) && c.get(4));
  c.put(5, buf, 1000);  // larger than the whole cache: not kept, nothing evicted
  EXPECT_FALSE(c.get(5));
  EXPECT_EQ(c.size(), 3u);
  EXPECT_LE(c.bytes(), c.capacity());
}

TEST(ExpertsStore, LfuKeepsFrequentlyUsed) {
  ExpertCache c(200, CachePolicy::Lfu);
  auto buf = std::make_shared<int>(0);
  c.put(1, buf, 100);
  for (int i = 0; i < 5; ++i) c.get(1);
  c.put(2, buf, 100);
  c.get(2);
  c.put(3, buf, 100);  // evicts 2 (used once), although 1 is older
  EXPECT_TRUE(c.get(1));
  EXPECT_FALSE(c.get(2));
  EXPECT_TRUE(c.get(3));
}

TEST(ExpertsStore, StatsCountReadsAndHits) {
  Packed p;
  auto model = QwenModel::load(p.dir, streaming(64));
  ThreadPool pool(1);
  Session s(test::cpu_of(*model), KvConfig{}, pool);
  s.feed(p.ids);
  ExpertStats a = model->expert_store().stats();
  EXPECT_EQ(a.tokens, p.ids.size());
  EXPECT_EQ(a.hits + a.misses, a.requested);
  EXPECT_EQ(a.bytes_read, a.misses * a.expert_bytes);
  s.feed(p.ids);  // every expert is cached now: no more reads
  ExpertStats b = model->expert_store().stats();
  EXPECT_EQ(b.misses, a.misses);
  EXPECT_GT(b.hits, a.hits);
}

TEST(ExpertsStore, CorruptExpertBytesNameFileAndExpert) {
  Packed p;
  const std::string f = p.dir + "/experts/layer-000.bin";
  auto m = p.manifest();
  // Flip one byte inside every expert of layer 0, so whichever is routed to fails.
  int fd = ::open(f.c_str(), O_RDWR);
  for (const auto& e : m["layers"][0]["experts"]) {
    uint8_t b;
    const off_t at = off_t(e["offset"].get<uint64_t>() + 1000);
    ASSERT_EQ(::pread(fd, &b, 1, at), 1);
    b ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
  }
  ::close(fd);
  for (const char* store : {"stream", "mmap"}) {
    ExpertOptions o = streaming();
    o.store = store;
    std::string err = error_of([&] { run_logits(p.dir, p.ids, o); });
    EXPECT_NE(err.find("layer-000.bin"), std::string::npos) << store << ": " << err;
    EXPECT_NE(err.find("expert "), std::string::npos) << err;
    EXPECT_NE(err.find("checksum"), std::string::npos) << err;
  }
}

TEST(ExpertsStore, TruncatedExpertFileIsAnError) {
  Packed p;
  const std::string f = p.dir + "/experts/layer-002.bin";
  // Caught when the model is opened (size differs from the manifest)...
  {
    auto m = p.manifest();
    ASSERT_EQ(::truncate(f.c_str(), off_t(m["layers"][2]["file_bytes"].get<uint64_t>() / 2)), 0);
    std::string err = error_of([&] { QwenModel::load(p.dir, streaming()); });
    EXPECT_NE(err.find("layer-002.bin"), std::string::npos) << err;
    EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  }
}

TEST(ExpertsStore, FileTruncatedWhileRunningGivesShortReadError) {
  Packed p;
  auto model = QwenModel::load(p.dir, streaming(0));
  ASSERT_EQ(::truncate((p.dir + "/experts/layer-001.bin").c_str(), 0), 0);
  ThreadPool pool(1);
  Session s(test::cpu_of(*model), KvConfig{}, pool);
  std::string err = error_of([&] { s.feed(p.ids); });
  EXPECT_NE(err.find("layer-001.bin"), std::string::npos) << err;
  EXPECT_NE(err.find("short read"), std::string::npos) << err;
}

TEST(ExpertsStore, NewerManifestVersionIsAClearError) {
  Packed p;
  auto m = p.manifest();
  m["version"] = kPackedFormatVersion + 1;
  p.write_manifest(m);
  std::string err = error_of([&] { QwenModel::load(p.dir); });
  EXPECT_NE(err.find("newer flashmoe"), std::string::npos) << err;
  EXPECT_NE(err.find(kManifestName), std::string::npos) << err;
}

TEST(ExpertsStore, ManifestNotMatchingFilesIsAnError) {
  {
    Packed p;
    auto m = p.manifest();
    m["layers"][1]["file"] = "experts/missing.bin";
    p.write_manifest(m);
    EXPECT_NE(error_of([&] { QwenModel::load(p.dir); }).find("missing.bin"), std::string::npos);
  }
  {
    Packed p;
    auto m = p.manifest();
    m["layers"][0]["experts"][3]["offset"] = m["layers"][0]["file_bytes"];
    p.write_manifest(m);
    std::string err = error_of([&] { QwenModel::load(p.dir); });
    EXPECT_NE(err.find("expert 3 of layer 0"), std::string::npos) << err;
  }
  {
    Packed p;
    auto m = p.manifest();
    m["layers"].erase(m["layers"].begin() + 4);
    p.write_manifest(m);
    EXPECT_NE(error_of([&] { QwenModel::load(p.dir); }).find("MoE layer"), std::string::npos);
  }
  {
    Packed p;
    auto m = p.manifest();
    m["experts"]["format"] = "q4";  // layout claims q4, files hold bf16
    m["experts"]["group"] = 64;
    p.write_manifest(m);
    std::string err = error_of([&] { QwenModel::load(p.dir); });
    EXPECT_NE(err.find("expert layout is inconsistent"), std::string::npos) << err;
    EXPECT_NE(err.find(kManifestName), std::string::npos) << err;
  }
}

// fuzz_manifest: a number field written as a float beyond its type's range
// (4.91e54 as an offset) was converted with undefined behaviour, and a
// negative size wrapped. Each is a malformed manifest naming the field.
TEST(ExpertsStore, ManifestNumbersOutsideTheirTypeAreAnError) {
  const std::vector<std::function<void(nlohmann::json&)>> edits = {
      [](nlohmann::json& m) { m["layers"][0]["experts"][0]["offset"] = 4.91e54; },
      [](nlohmann::json& m) { m["layers"][0]["experts"][0]["size"] = -1; },
      [](nlohmann::json& m) { m["layers"][0]["file_bytes"] = 1.5; },
      [](nlohmann::json& m) { m["experts"]["bytes"] = 1e300; },
      [](nlohmann::json& m) { m["version"] = int64_t(1) << 40; },
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    Packed p;
    auto m = p.manifest();
    edits[i](m);
    p.write_manifest(m);
    const std::string err = error_of([&] { QwenModel::load(p.dir); });
    EXPECT_NE(err.find("malformed manifest"), std::string::npos) << "edit " << i << ": " << err;
  }
}

TEST(ExpertsStore, MaxMemoryRefusesWhatCannotFit) {
  Packed p;
  ExpertOptions o = streaming(-1);
  o.max_memory_gb = 0.01;  // 10 MiB: less than the runtime allowance alone
  std::string err = error_of([&] { QwenModel::load(p.dir, o); });
  EXPECT_NE(err.find("--max-memory"), std::string::npos) << err;
  EXPECT_NE(err.find("non-expert weights"), std::string::npos) << err;
  o.max_memory_gb = 1;
  o.cache_mb = 4096;  // a cache larger than the budget
  EXPECT_NE(error_of([&] { QwenModel::load(p.dir, o); }).find("--expert-cache"), std::string::npos);
  o.cache_mb = -1;  // sized automatically: fits
  EXPECT_EQ(error_of([&] { run_logits(p.dir, p.ids, o); }), "");
}

TEST(ExpertsStore, StreamingAnUnpackedModelIsRefused) {
  ExpertOptions o = streaming();
  std::string err = error_of([&] { QwenModel::load(source_path(std::string(kTiny) + "/model"), o); });
  EXPECT_NE(err.find("flashmoe pack"), std::string::npos) << err;
}

}  // namespace experts_store_test
