#include "experts/memory_store.h"

#include <mutex>
#include <utility>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/xxhash64.h"

namespace flashmoe {

namespace {

// What both in-memory stores share: every fetch is a hit, and the counters
// are guarded by a lock because `serve --parallel` fetches from several
// sessions at once.
class InMemoryStore : public ExpertStore {
 public:
  ExpertStats stats() const override {
    std::lock_guard<std::mutex> lk(stats_mu_);
    return stats_;
  }
  void reset_stats() override {
    std::lock_guard<std::mutex> lk(stats_mu_);
    stats_ = ExpertStats{.expert_bytes = stats_.expert_bytes};
  }
  void note_tokens(int64_t n) override {
    std::lock_guard<std::mutex> lk(stats_mu_);
    stats_.tokens += n;
  }

 protected:
  explicit InMemoryStore(uint64_t expert_bytes) { stats_.expert_bytes = expert_bytes; }
  void count_hits(size_t n) {
    std::lock_guard<std::mutex> lk(stats_mu_);
    stats_.requested += n;
    stats_.hits += n;
  }

 private:
  mutable std::mutex stats_mu_;
  ExpertStats stats_;
};

class WeightsStore : public InMemoryStore {
 public:
  WeightsStore(LayerExpertViews layers, uint64_t expert_bytes)
      : InMemoryStore(expert_bytes), layers_(std::move(layers)) {}
  ExpertBatch fetch(int64_t layer, const std::vector<int32_t>& ids,
                    const std::function<void()>& /*while_waiting: nothing is read*/) override {
    ExpertBatch b;
    for (int32_t id : ids) b.experts.push_back((*layers_[layer])[id]);
    count_hits(ids.size());
    return b;
  }
  std::string describe() const override { return "in memory (mmapped checkpoint)"; }

 private:
  LayerExpertViews layers_;
};

class MmapPackedStore : public InMemoryStore {
 public:
  explicit MmapPackedStore(const PackedManifest& m) : InMemoryStore(m.layout.bytes), m_(m) {
    for (const auto& l : m_.layers) {
      if (size_t(l.layer) >= files_.size()) files_.resize(l.layer + 1), verified_.resize(l.layer + 1);
      files_[l.layer] = std::make_unique<MappedFile>(m_.path_of(l));
      verified_[l.layer].assign(l.experts.size(), false);
    }
  }
  ExpertBatch fetch(int64_t layer, const std::vector<int32_t>& ids,
                    const std::function<void()>& /*while_waiting: nothing is read*/) override {
    std::lock_guard<std::mutex> lk(mu_);
    const PackedLayer* pl = m_.find_layer(layer);
    ExpertBatch b;
    for (int32_t id : ids) {
      const PackedExpert& e = pl->experts[id];
      const uint8_t* base = files_[layer]->data() + e.offset;
      if (!verified_[layer][id]) {
        if (xxhash64(base, e.size) != e.xxh64)
          fail(m_.path_of(*pl) + ": expert " + std::to_string(id) + " of layer " + std::to_string(layer) +
               " fails its checksum: the file is corrupt (re-run flashmoe pack)");
        verified_[layer][id] = true;
      }
      b.experts.push_back(m_.layout.views(base));
    }
    count_hits(ids.size());
    return b;
  }
  std::string describe() const override { return "in memory (mmapped packed files, " + m_.layout.format_name() + ")"; }

 private:
  PackedManifest m_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::vector<std::vector<bool>> verified_;
  std::mutex mu_;  // guards verified_
};

}  // namespace

std::unique_ptr<ExpertStore> make_weights_store(LayerExpertViews layers, uint64_t expert_bytes) {
  return std::make_unique<WeightsStore>(std::move(layers), expert_bytes);
}

std::unique_ptr<ExpertStore> make_mmap_packed_store(const PackedManifest& m) {
  return std::make_unique<MmapPackedStore>(m);
}

}  // namespace flashmoe
