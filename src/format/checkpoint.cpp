#include "format/checkpoint.h"

#include <dirent.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/mapped_file.h"

namespace flashmoe {

using nlohmann::json;

namespace {

std::vector<std::string> list_safetensors(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

}  // namespace

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  if (!is_directory(dir)) fail("model directory not found: " + dir);
  std::vector<std::string> shards;
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (file_exists(index_path)) {
    json idx;
    try {
      idx = json::parse(read_text_file(index_path));
    } catch (const json::exception& e) {
      fail(index_path + ": not valid JSON (" + e.what() + ")");
    }
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object())
      fail(index_path + ": no weight_map object");
    std::set<std::string> seen;
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      if (!it.value().is_string()) fail(index_path + ": weight_map entry '" + it.key() + "' is not a file name");
      std::string f = it.value().get<std::string>();
      if (f.find('/') != std::string::npos || f == "..")
        fail(index_path + ": shard name '" + f + "' must be a plain file name");
      if (seen.insert(f).second) shards.push_back(f);
    }
    for (const auto& f : shards)
      if (!file_exists(dir + "/" + f)) fail(index_path + " names shard " + f + ", which is missing from " + dir);
  } else {
    shards = list_safetensors(dir);
    if (shards.empty()) fail(dir + ": no .safetensors files in model directory");
  }
  for (const auto& f : shards) {
    files_.push_back(std::make_unique<SafetensorsFile>(dir + "/" + f));
    for (const auto& n : files_.back()->names()) where_.emplace(n, files_.back().get());
  }
  bool wrapper = std::any_of(where_.begin(), where_.end(),
                             [](const auto& kv) { return starts_with(kv.first, "model.language_model."); });
  prefix_ = wrapper ? "model.language_model." : "model.";
}

std::string Checkpoint::full_name(const std::string& name) const {
  return name.size() && name[0] == '/' ? name.substr(1) : prefix_ + name;
}

bool Checkpoint::has(const std::string& name) const { return where_.count(full_name(name)) != 0; }

TensorView Checkpoint::get(const std::string& name) const {
  std::string full = full_name(name);
  auto it = where_.find(full);
  if (it == where_.end()) fail(dir_ + ": checkpoint has no tensor '" + full + "'");
  return it->second->get(full);
}

TensorView Checkpoint::expect(const std::string& name, const std::vector<int64_t>& shape) const {
  TensorView t = get(name);
  if (t.shape != shape)
    fail(dir_ + ": tensor '" + t.name + "' has shape " + t.shape_str() + ", expected " +
         shape_to_string(shape) + " from config.json");
  if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32)
    fail(dir_ + ": tensor '" + t.name + "' has dtype " + dtype_name(t.dtype) +
         "; flashmoe reads BF16, F16 and F32 weights");
  return t;
}

Matrix Checkpoint::matrix(const std::string& name, int64_t rows, int64_t cols) const {
  TensorView t = expect(name, {rows, cols});
  return Matrix{t.dtype, t.data, rows, cols};
}

std::vector<float> Checkpoint::vector_f32(const std::string& name, const std::vector<int64_t>& shape) const {
  TensorView t = expect(name, shape);
  std::vector<float> out(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const void* p = t.data;
    switch (t.dtype) {
      case DType::F32: out[i] = static_cast<const float*>(p)[i]; break;
      case DType::BF16: out[i] = bf16_to_f32(static_cast<const uint16_t*>(p)[i]); break;
      default: out[i] = f16_to_f32(static_cast<const uint16_t*>(p)[i]); break;
    }
  }
  return out;
}

int64_t Checkpoint::total_bytes() const {
  int64_t n = 0;
  for (const auto& kv : where_) {
    TensorView t = kv.second->get(kv.first);
    n += int64_t(t.nbytes());
  }
  return n;
}

}  // namespace flashmoe
