// The manifest of a packed model directory (flashmoe-manifest.json): which
// file holds each MoE layer's experts, where each expert starts, its size and
// XXH64 checksum, and the expert format. Its presence is what marks a
// directory as packed; pack writes it last, inside a temporary directory.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "experts/expert_layout.h"
#include "format/config.h"

namespace flashmoe {

constexpr int kPackedFormatVersion = 1;
constexpr const char* kManifestName = "flashmoe-manifest.json";

struct PackedExpert {
  uint64_t offset = 0, size = 0, xxh64 = 0;
};

struct PackedLayer {
  int64_t layer = 0;
  std::string file;        // relative to the model directory
  uint64_t file_bytes = 0;
  std::vector<PackedExpert> experts;
};

struct PackedManifest {
  int version = kPackedFormatVersion;
  std::string dir;         // where it was read from (for messages and paths)
  ExpertLayout layout;
  std::vector<PackedLayer> layers;  // MoE layers only, ascending

  const PackedLayer* find_layer(int64_t layer) const;
  std::string path_of(const PackedLayer& l) const { return dir + "/" + l.file; }
  uint64_t total_expert_bytes() const;
};

bool is_packed_dir(const std::string& dir);

// Reads and checks the manifest against config.json and the layer files on
// disk (existence, sizes, offsets): throws Error naming the first mismatch.
PackedManifest read_manifest(const std::string& dir, const ModelConfig& cfg);
// The same checks on manifest text already read (`dir` locates the layer files).
PackedManifest parse_manifest(const std::string& text, const std::string& dir, const ModelConfig& cfg);

// Serialises the manifest; `config_json` is config.json's text, copied in.
std::string manifest_to_json(const PackedManifest& m, const std::string& config_json);

}  // namespace flashmoe
