#include "experts/manifest.h"

#include <sys/stat.h>

#include <cstdio>
#include <limits>
#include <string>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"

namespace flashmoe {

using nlohmann::json;

namespace {

// An integer field of the manifest: a number that is not an integer within
// T's range would be converted with undefined behaviour (a float beyond the
// range) or wrap, so it is refused as a malformed manifest.
template <class T>
T int_field(const json& v, const char* what, const std::string& path) {
  const bool fits = v.is_number_unsigned()
                        ? v.get<uint64_t>() <= uint64_t(std::numeric_limits<T>::max())
                        : v.is_number_integer() && v.get<int64_t>() >= int64_t(std::numeric_limits<T>::min()) &&
                              (std::numeric_limits<T>::max() >= uint64_t(INT64_MAX) ||
                               v.get<int64_t>() <= int64_t(std::numeric_limits<T>::max()));
  if (!fits)
    fail(path + ": malformed manifest (field '" + what + "' is not an integer in range: " + v.dump() + ")");
  return v.is_number_unsigned() ? T(v.get<uint64_t>()) : T(v.get<int64_t>());
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

json part_json(const ExpertPart& p) {
  return {{"rows", p.rows}, {"cols", p.cols}, {"offset", p.offset}, {"bytes", p.bytes},
          {"scales", p.scales}, {"biases", p.biases}};
}

}  // namespace

const PackedLayer* PackedManifest::find_layer(int64_t layer) const {
  for (const auto& l : layers)
    if (l.layer == layer) return &l;
  return nullptr;
}

uint64_t PackedManifest::total_expert_bytes() const {
  uint64_t n = 0;
  for (const auto& l : layers) n += l.experts.size() * layout.bytes;
  return n;
}

bool is_packed_dir(const std::string& dir) { return file_exists(dir + "/" + kManifestName); }

std::string manifest_to_json(const PackedManifest& m, const std::string& config_json) {
  json j;
  j["format"] = "flashmoe-packed";
  j["version"] = m.version;
  j["config"] = json::parse(config_json);
  j["experts"] = {{"format", m.layout.format_name()}, {"group", m.layout.group}, {"bytes", m.layout.bytes},
                  {"alignment", kExpertAlign}, {"checksum", "xxh64"},
                  {"gate", part_json(m.layout.gate)}, {"up", part_json(m.layout.up)}, {"down", part_json(m.layout.down)}};
  if (m.layout.quant == QuantKind::Fp8Block) j["experts"]["block_rows"] = m.layout.block_rows;
  j["non_expert_weights"] = {"model.safetensors"};
  json layers = json::array();
  for (const auto& l : m.layers) {
    json ex = json::array();
    for (const auto& e : l.experts) ex.push_back({{"offset", e.offset}, {"size", e.size}, {"xxh64", hex64(e.xxh64)}});
    layers.push_back({{"layer", l.layer}, {"file", l.file}, {"file_bytes", l.file_bytes}, {"experts", ex}});
  }
  j["layers"] = layers;
  return j.dump(1);
}

PackedManifest read_manifest(const std::string& dir, const ModelConfig& cfg) {
  return parse_manifest(read_text_file(dir + "/" + kManifestName), dir, cfg);
}

PackedManifest parse_manifest(const std::string& text, const std::string& dir, const ModelConfig& cfg) {
  const std::string path = dir + "/" + kManifestName;
  auto bad = [&](const std::string& why) -> void { fail(path + ": " + why); };
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(path + ": not valid JSON (" + e.what() + ")");
  }
  PackedManifest m;
  m.dir = dir;
  try {
    if (!j.is_object() || j.value("format", "") != "flashmoe-packed") bad("not a flashmoe packed-model manifest");
    if (!j.contains("version") || !j["version"].is_number_integer()) bad("missing format version");
    m.version = int_field<int>(j["version"], "version", path);
    if (m.version > kPackedFormatVersion)
      bad("format version " + std::to_string(m.version) + " was written by a newer flashmoe; this build reads up to version " +
          std::to_string(kPackedFormatVersion) + " (upgrade flashmoe or re-pack the model)");
    if (m.version < 1) bad("invalid format version " + std::to_string(m.version));
    const json& ex = j.at("experts");
    QuantKind q = parse_expert_format(ex.at("format").get<std::string>(), path);
    try {
      const int32_t block_rows = ex.contains("block_rows") ? int_field<int32_t>(ex.at("block_rows"), "block_rows", path) : 0;
      m.layout = ExpertLayout::make(cfg.hidden_size, cfg.moe_intermediate, q, int_field<int32_t>(ex.at("group"), "group", path),
                                    block_rows);
    } catch (const Error& e) {
      bad(std::string("experts section does not describe a valid layout: ") + e.what());
    }
    if (int_field<uint64_t>(ex.at("bytes"), "bytes", path) != m.layout.bytes || int_field<uint64_t>(ex.at("gate").at("offset"), "gate.offset", path) != m.layout.gate.offset ||
        int_field<int64_t>(ex.at("down").at("rows"), "down.rows", path) != m.layout.down.rows || int_field<int64_t>(ex.at("down").at("cols"), "down.cols", path) != m.layout.down.cols)
      bad("expert layout is inconsistent: format " + m.layout.format_name() + " with hidden size " +
          std::to_string(cfg.hidden_size) + " and moe_intermediate " + std::to_string(cfg.moe_intermediate) +
          " (config.json) needs " + std::to_string(m.layout.bytes) + " bytes per expert, the manifest says " +
          std::to_string(int_field<uint64_t>(ex.at("bytes"), "bytes", path)) + " (manifest and files are from different packs?)");
    for (const json& lj : j.at("layers")) {
      PackedLayer l;
      l.layer = int_field<int64_t>(lj.at("layer"), "layer", path);
      l.file = lj.at("file").get<std::string>();
      l.file_bytes = int_field<uint64_t>(lj.at("file_bytes"), "file_bytes", path);
      if (l.file.find("..") != std::string::npos || l.file.empty() || l.file[0] == '/')
        bad("layer file '" + l.file + "' must be a relative path inside the model directory");
      for (const json& e : lj.at("experts")) {
        PackedExpert pe;
        pe.offset = int_field<uint64_t>(e.at("offset"), "offset", path);
        pe.size = int_field<uint64_t>(e.at("size"), "size", path);
        pe.xxh64 = std::stoull(e.at("xxh64").get<std::string>(), nullptr, 16);
        l.experts.push_back(pe);
      }
      m.layers.push_back(std::move(l));
    }
  } catch (const json::exception& e) {
    fail(path + ": malformed manifest (" + e.what() + ")");
  } catch (const std::logic_error& e) {
    fail(path + ": malformed manifest (bad checksum text)");
  }

  // Cross-check against the config and the files actually present.
  size_t moe_layers = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    if (!cfg.layer_is_moe[i]) continue;
    ++moe_layers;
    if (!m.find_layer(i)) bad("has no expert file for MoE layer " + std::to_string(i));
  }
  if (m.layers.size() != moe_layers)
    bad("lists " + std::to_string(m.layers.size()) + " expert layers but config.json has " + std::to_string(moe_layers) + " MoE layers");
  for (const auto& l : m.layers) {
    const std::string f = m.path_of(l);
    if (l.experts.size() != size_t(cfg.num_experts))
      bad("layer " + std::to_string(l.layer) + " lists " + std::to_string(l.experts.size()) + " experts, config.json says " +
          std::to_string(cfg.num_experts));
    struct stat st;
    if (::stat(f.c_str(), &st) != 0) fail(f + ": expert file named by the manifest is missing");
    if (uint64_t(st.st_size) != l.file_bytes)
      fail(f + ": file is " + std::to_string(st.st_size) + " bytes but the manifest says " + std::to_string(l.file_bytes) +
           " (truncated or replaced; re-run flashmoe pack)");
    for (size_t e = 0; e < l.experts.size(); ++e) {
      const PackedExpert& pe = l.experts[e];
      if (pe.size != m.layout.bytes || pe.offset % kExpertAlign != 0 || pe.offset + align_up(pe.size, kExpertAlign) > l.file_bytes)
        fail(f + ": expert " + std::to_string(e) + " of layer " + std::to_string(l.layer) +
             " has an offset/size in the manifest that does not fit the file");
    }
  }
  return m;
}

}  // namespace flashmoe
