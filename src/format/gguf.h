// The GGUF format (version 3, as llama.cpp writes it): a header, typed
// key/value metadata, tensor descriptions, then the tensor data at aligned
// offsets. Files are mmapped and read in place. Every count, length, offset
// and size is checked against the file before it is used, so a truncated or
// corrupt file gives one Error naming the file and the problem.
//
// A model may be split into NAME-00001-of-0000N.gguf ... files (llama.cpp's
// gguf-split): GgufModel opens the first one and its siblings and presents
// the tensors of all of them, the metadata of the first.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/mapped_file.h"

namespace flashmoe {

// ggml's tensor types, numbered as in the file (gaps are types ggml removed).
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

// Elements per block and bytes per block of a type; false for a number that
// is no ggml type.
bool ggml_type_block(uint32_t type, int64_t* block_elems, int64_t* block_bytes);
std::string ggml_type_name(uint32_t type);  // "Q4_K", or "type 77" when unknown

enum class GgufValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7, String = 8, Array = 9,
  U64 = 10, I64 = 11, F64 = 12,
};

// One metadata value. Scalars: integers in `i` (unsigned ones too, up to
// 2^63), floats in `f`, bools in `i` (0/1), strings in `s`. Arrays: `elem`
// says the element type; strings go to `strings`, numbers to `ints` (and
// `floats` for float elements), nested arrays to `items`.
struct GgufValue {
  GgufValueType type = GgufValueType::U8;
  GgufValueType elem = GgufValueType::U8;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;
  std::vector<GgufValue> items;
  uint64_t array_size = 0;

  bool is_int() const;  // an integer or bool scalar
  bool is_number() const { return is_int() || type == GgufValueType::F32 || type == GgufValueType::F64; }
};

struct GgufTensor {
  std::string name;
  uint32_t type = 0;
  std::vector<int64_t> ne;  // ggml order: ne[0] is the contiguous (row) dimension
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
  const std::string* file = nullptr;  // path of the file holding it
  int64_t numel() const;
};

class GgufFile {
 public:
  explicit GgufFile(const std::string& path);  // throws Error naming the file
  const std::string& path() const { return file_.path(); }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

 private:
  MappedFile file_;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
};

class GgufModel {
 public:
  // `path`: a .gguf file, or the first part of a split model.
  explicit GgufModel(const std::string& path);

  const std::string& path() const { return path_; }
  bool has(const std::string& key) const { return meta().count(key) != 0; }
  const GgufValue* find(const std::string& key) const;
  // Typed getters: throw Error naming the file and key when absent or of the wrong type.
  const GgufValue& get(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_float(const std::string& key, double def) const;
  std::string get_string(const std::string& key) const;
  const std::map<std::string, GgufValue>& meta() const { return files_.front()->metadata(); }

  bool has_tensor(const std::string& name) const { return tensors_.count(name) != 0; }
  const GgufTensor* tensor(const std::string& name) const;  // nullptr when absent
  const std::map<std::string, const GgufTensor*>& tensors() const { return tensors_; }
  uint64_t total_bytes() const;

 private:
  std::string path_;
  std::vector<std::unique_ptr<GgufFile>> files_;
  std::map<std::string, const GgufTensor*> tensors_;
};

// True for a path ending in ".gguf".
bool is_gguf_path(const std::string& path);

}  // namespace flashmoe
