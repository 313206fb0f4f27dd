#include "experts/manifest.h"

#include <sys/stat.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"

namespace flashmoe {

using nlohmann::json;

namespace {

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
    m.version = j["version"].get<int>();
    if (m.version > kPackedFormatVersion)
      bad("format version " + std::to_string(m.version) + " was written by a newer flashmoe; this build reads up to version " +
          std::to_string(kPackedFormatVersion) + " (upgrade flashmoe or re-pack the model)");
    if (m.version < 1) bad("invalid format version " + std::to_string(m.version));
    const json& ex = j.at("experts");
    QuantKind q = parse_expert_format(ex.at("format").get<std::string>(), path);
    try {
      m.layout = ExpertLayout::make(cfg.hidden_size, cfg.moe_intermediate, q, ex.at("group").get<int32_t>());
    } catch (const Error& e) {
      bad(std::string("experts section does not describe a valid layout: ") + e.what());
    }
    if (ex.at("bytes").get<uint64_t>() != m.layout.bytes || ex.at("gate").at("offset").get<uint64_t>() != m.layout.gate.offset ||
        ex.at("down").at("rows").get<int64_t>() != m.layout.down.rows || ex.at("down").at("cols").get<int64_t>() != m.layout.down.cols)
      bad("expert layout is inconsistent: format " + m.layout.format_name() + " with hidden size " +
          std::to_string(cfg.hidden_size) + " and moe_intermediate " + std::to_string(cfg.moe_intermediate) +
          " (config.json) needs " + std::to_string(m.layout.bytes) + " bytes per expert, the manifest says " +
          std::to_string(ex.at("bytes").get<uint64_t>()) + " (manifest and files are from different packs?)");
    for (const json& lj : j.at("layers")) {
      PackedLayer l;
      l.layer = lj.at("layer").get<int64_t>();
      l.file = lj.at("file").get<std::string>();
      l.file_bytes = lj.at("file_bytes").get<uint64_t>();
      if (l.file.find("..") != std::string::npos || l.file.empty() || l.file[0] == '/')
        bad("layer file '" + l.file + "' must be a relative path inside the model directory");
      for (const json& e : lj.at("experts")) {
        PackedExpert pe;
        pe.offset = e.at("offset").get<uint64_t>();
        pe.size = e.at("size").get<uint64_t>();
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
