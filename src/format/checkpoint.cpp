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
  const bool mlx_wrapper = std::any_of(where_.begin(), where_.end(),
                                      [](const auto& kv) { return starts_with(kv.first, "language_model.model."); });
  prefix_ = wrapper ? "model.language_model." : mlx_wrapper ? "language_model.model." : "model.";

  const std::string cfg_path = dir + "/config.json";
  if (file_exists(cfg_path)) quant_ = parse_quantization_config(read_text_file(cfg_path), cfg_path);
}

std::string Checkpoint::full_name(const std::string& name) const {
  return name.size() && name[0] == '/' ? name.substr(1) : prefix_ + name;
}

bool Checkpoint::has(const std::string& name) const { return where_.count(full_name(name)) != 0; }

TensorView Checkpoint::get(const std::string& name) const {
  std::string full = full_name(name);
  auto it = where_.find(full);
  if (it == where_.end())
    fail(dir_ + ": checkpoint has no tensor '" + full +
         "', which config.json implies (the checkpoint is incomplete, or config.json does not describe it)");
  TensorView t = it->second->get(full);
  used_.insert(full);
  return t;
}

std::vector<std::string> Checkpoint::unused_tensors() const {
  std::vector<std::string> out;
  for (const auto& kv : where_)
    if (starts_with(kv.first, prefix_) && !used_.count(kv.first)) out.push_back(kv.first);
  return out;
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

std::string Checkpoint::lm_head_name() const {
  return prefix_ == "language_model.model." ? "/language_model.lm_head.weight" : "/lm_head.weight";
}

Matrix Checkpoint::matrix(const std::string& name, int64_t rows, int64_t cols) const {
  return any_matrix(name, 0, rows, cols);
}

Matrix Checkpoint::stacked_matrix(const std::string& name, int64_t count, int64_t rows, int64_t cols) const {
  return any_matrix(name, count, rows, cols);
}

Matrix Checkpoint::any_matrix(const std::string& name, int64_t lead, int64_t rows, int64_t cols) const {
  TensorView raw = get(name);
  if (raw.dtype == DType::U32 || raw.dtype == DType::I32) return quantized_matrix(raw, lead, rows, cols);
  if (raw.dtype == DType::F8_E4M3) return fp8_matrix(raw, lead, rows, cols);
  TensorView t = lead ? expect(name, {lead, rows, cols}) : expect(name, {rows, cols});
  return Matrix{t.dtype, t.data, (lead ? lead : 1) * rows, cols};
}

Matrix Checkpoint::fp8_matrix(const TensorView& w, int64_t lead, int64_t rows, int64_t cols) const {
  const std::string& n = w.name;
  const Fp8BlockQuantization& f = quant_.fp8;
  if (!f.present)
    fail(dir_ + ": tensor '" + n + "' is F8_E4M3 but config.json has no 'quantization_config' with quant_method 'fp8'");
  std::vector<int64_t> shape = {rows, cols};
  if (lead) shape.insert(shape.begin(), lead);
  if (w.shape != shape)
    fail(dir_ + ": tensor '" + n + "' has shape " + w.shape_str() + ", expected " + shape_to_string(shape) + " from config.json");
  if (lead && rows % f.block_rows != 0)
    fail(dir_ + ": tensor '" + n + "': stacked FP8 matrices of " + std::to_string(rows) +
         " rows do not split into blocks of " + std::to_string(f.block_rows) + " rows");
  std::vector<int64_t> side = {(rows + f.block_rows - 1) / f.block_rows, (cols + f.block_cols - 1) / f.block_cols};
  if (lead) side.insert(side.begin(), lead);
  const std::string sname = "/" + n + "_scale_inv";
  if (!has(sname))
    fail(dir_ + ": tensor '" + n + "' is F8_E4M3 but its block scales '" + n + "_scale_inv' are missing");
  TensorView sc = get(sname);
  if (sc.shape != side)
    fail(dir_ + ": tensor '" + sc.name + "' has shape " + sc.shape_str() + ", expected " + shape_to_string(side) +
         " (blocks of [" + std::to_string(f.block_rows) + ", " + std::to_string(f.block_cols) + "] over " +
         shape_to_string(shape) + ")");
  if (sc.dtype != DType::F32)
    fail(dir_ + ": tensor '" + sc.name + "' has dtype " + dtype_name(sc.dtype) + "; FP8 block scales must be F32");
  Matrix m;
  m.dtype = DType::U8;
  m.data = w.data;
  m.rows = (lead ? lead : 1) * rows;
  m.cols = cols;
  m.quant = QuantKind::Fp8Block;
  m.group = f.block_cols;
  m.block_rows = f.block_rows;
  m.block_scales = reinterpret_cast<const float*>(sc.data);
  return m;
}

Matrix Checkpoint::quantized_matrix(const TensorView& w, int64_t lead, int64_t rows, int64_t cols) const {
  const std::string& n = w.name;
  const std::string stem = n.size() > 7 && n.compare(n.size() - 7, 7, ".weight") == 0 ? n.substr(0, n.size() - 7) : n;
  if (!quant_.mlx.present)
    fail(dir_ + ": tensor '" + n + "' is packed (" + dtype_name(w.dtype) +
         ") but config.json has no 'quantization' {group_size, bits}");
  const GroupQuant q = quant_.mlx.of(stem);
  if (q.bits == 0)
    fail(dir_ + ": tensor '" + n + "' is packed (" + dtype_name(w.dtype) + ") but config.json's 'quantization' says module '" +
         stem + "' is not quantised");
  const int bits = q.bits, group = q.group;
  if (cols % group != 0 || (cols * bits) % 32 != 0)
    fail(dir_ + ": tensor '" + n + "': " + std::to_string(cols) + " columns do not split into groups of " +
         std::to_string(group));
  std::vector<int64_t> packed = {rows, cols * bits / 32}, side = {rows, cols / group};
  if (lead) {
    packed.insert(packed.begin(), lead);
    side.insert(side.begin(), lead);
  }
  if (w.shape != packed)
    fail(dir_ + ": tensor '" + n + "' has shape " + w.shape_str() + ", expected " + shape_to_string(packed) +
         " for " + std::to_string(bits) + "-bit weights of [" + std::to_string(rows) + ", " +
         std::to_string(cols) + "] (group_size " + std::to_string(group) + ")");
  TensorView sc = get("/" + stem + ".scales"), bi = get("/" + stem + ".biases");
  for (const TensorView* t : {&sc, &bi}) {
    if (t->shape != side)
      fail(dir_ + ": tensor '" + t->name + "' has shape " + t->shape_str() + ", expected " + shape_to_string(side));
    if (t->dtype != DType::BF16)
      fail(dir_ + ": tensor '" + t->name + "' has dtype " + dtype_name(t->dtype) + "; quantisation scales and biases must be BF16");
  }
  Matrix m;
  m.dtype = DType::U8;
  m.data = w.data;
  m.rows = (lead ? lead : 1) * rows;
  m.cols = cols;
  m.quant = bits == 4 ? QuantKind::Q4 : QuantKind::Q8;
  m.group = group;
  m.scales = reinterpret_cast<const uint16_t*>(sc.data);
  m.biases = reinterpret_cast<const uint16_t*>(bi.data);
  return m;
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

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> out;
  for (const auto& kv : where_) out.push_back(kv.first);
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
