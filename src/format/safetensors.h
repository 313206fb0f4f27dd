// The safetensors format: an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}}, then the raw data. Every offset and
// size in the header is checked against the file before any tensor is used.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "core/tensor.h"

namespace flashmoe {

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws Error naming the file

  const std::string& path() const { return file_.path(); }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  // Throws Error if absent or of a dtype flashmoe cannot read.
  TensorView get(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  struct Entry {
    std::string dtype_str;
    bool dtype_known = false;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    size_t begin = 0, end = 0;
  };
  MappedFile file_;
  const uint8_t* data_base_ = nullptr;
  std::map<std::string, Entry> entries_;
};

// A tensor to write: data is copied from `data` (nbytes = numel * dtype size).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
};

// Writes a safetensors file atomically (temporary file, then rename).
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);

}  // namespace flashmoe
