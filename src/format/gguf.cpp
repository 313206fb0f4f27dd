#include "format/gguf.h"

#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace flashmoe {

namespace {

// No real file comes near these; larger values mean a corrupt file.
constexpr uint64_t kMaxCount = uint64_t(1) << 32;
constexpr uint32_t kMaxDims = 4;
constexpr uint32_t kMaxNesting = 4;

struct TypeInfo {
  uint32_t id;
  const char* name;
  int64_t block_elems, block_bytes;
};

constexpr TypeInfo kTypes[] = {
    {0, "F32", 1, 4},        {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},     {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},     {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},     {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},   {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},  {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},  {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},  {20, "IQ4_NL", 32, 18},  {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},  {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},        {25, "I16", 1, 2},
    {26, "I32", 1, 4},       {27, "I64", 1, 8},        {28, "F64", 1, 8},       {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},      {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},  {39, "MXFP4", 32, 17},
};

const TypeInfo* type_info(uint32_t t) {
  for (const TypeInfo& i : kTypes)
    if (i.id == t) return &i;
  return nullptr;
}

// A bounds-checked cursor over the mapped file.
struct Cursor {
  const uint8_t* p;
  uint64_t size, at = 0;
  const std::string& path;

  [[noreturn]] void truncated(const std::string& what) const {
    fail(path + ": truncated or corrupt GGUF file (" + what + " at byte " + std::to_string(at) +
         " runs past the end, file is " + std::to_string(size) + " bytes)");
  }
  void need(uint64_t n, const std::string& what) const {
    if (n > size - at) truncated(what);
  }
  template <class T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string str(const std::string& what) {
    const uint64_t n = read<uint64_t>(what + " length");
    need(n, what);
    std::string s(reinterpret_cast<const char*>(p + at), size_t(n));
    at += n;
    return s;
  }
};

bool valid_value_type(uint32_t t) { return t <= 12; }

const char* value_type_name(GgufValueType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
  return uint32_t(t) <= 12 ? names[uint32_t(t)] : "?";
}

// Reads one scalar of type t into v's scalar fields.
void read_scalar(Cursor& c, GgufValueType t, const std::string& key, GgufValue* v) {
  const std::string what = "value of '" + key + "'";
  switch (t) {
    case GgufValueType::U8: v->i = c.read<uint8_t>(what); break;
    case GgufValueType::I8: v->i = c.read<int8_t>(what); break;
    case GgufValueType::U16: v->i = c.read<uint16_t>(what); break;
    case GgufValueType::I16: v->i = c.read<int16_t>(what); break;
    case GgufValueType::U32: v->i = c.read<uint32_t>(what); break;
    case GgufValueType::I32: v->i = c.read<int32_t>(what); break;
    case GgufValueType::U64: {
      uint64_t u = c.read<uint64_t>(what);
      if (u > uint64_t(INT64_MAX)) fail(c.path + ": metadata '" + key + "' is " + std::to_string(u) + ", too large");
      v->i = int64_t(u);
      break;
    }
    case GgufValueType::I64: v->i = c.read<int64_t>(what); break;
    case GgufValueType::F32: v->f = c.read<float>(what); break;
    case GgufValueType::F64: v->f = c.read<double>(what); break;
    case GgufValueType::Bool: {
      uint8_t b = c.read<uint8_t>(what);
      if (b > 1) fail(c.path + ": metadata '" + key + "': bool value " + std::to_string(b) + " is not 0 or 1");
      v->i = b;
      break;
    }
    case GgufValueType::String: v->s = c.str(what); break;
    case GgufValueType::Array: break;  // handled by read_value
  }
}

void read_value(Cursor& c, GgufValueType t, const std::string& key, GgufValue* v, uint32_t depth) {
  v->type = t;
  if (t != GgufValueType::Array) return read_scalar(c, t, key, v);
  if (depth >= kMaxNesting) fail(c.path + ": metadata '" + key + "': arrays nested too deeply");
  const uint32_t et = c.read<uint32_t>("array type of '" + key + "'");
  if (!valid_value_type(et))
    fail(c.path + ": metadata '" + key + "': unknown array element type " + std::to_string(et));
  v->elem = GgufValueType(et);
  const uint64_t n = c.read<uint64_t>("array length of '" + key + "'");
  // Each element takes at least one byte: a count beyond the bytes left is corrupt.
  if (n > c.size - c.at) c.truncated("array '" + key + "' of " + std::to_string(n) + " elements");
  v->array_size = n;
  GgufValue e;
  for (uint64_t k = 0; k < n; ++k) {
    if (v->elem == GgufValueType::Array) {
      v->items.emplace_back();
      read_value(c, GgufValueType::Array, key, &v->items.back(), depth + 1);
      continue;
    }
    read_scalar(c, v->elem, key, &e);
    if (v->elem == GgufValueType::String) v->strings.push_back(std::move(e.s));
    else if (v->elem == GgufValueType::F32 || v->elem == GgufValueType::F64) v->floats.push_back(e.f);
    else v->ints.push_back(e.i);
  }
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// "X-00001-of-00003.gguf" -> stem "X", part 1, count 3; false if not split-named.
bool split_name(const std::string& path, std::string* stem, int* part, int* count) {
  const size_t L = std::strlen("-00001-of-00003.gguf");
  if (path.size() < L || !ends_with(path, ".gguf")) return false;
  const std::string tail = path.substr(path.size() - L);
  int a = 0, b = 0;
  char dummy;
  if (tail[0] != '-' || tail.compare(6, 4, "-of-") != 0) return false;
  for (size_t k = 1; k < 6; ++k)
    if (tail[k] < '0' || tail[k] > '9') return false;
  for (size_t k = 10; k < 15; ++k)
    if (tail[k] < '0' || tail[k] > '9') return false;
  if (std::sscanf(tail.c_str(), "-%5d-of-%5d.gguf%c", &a, &b, &dummy) != 2) return false;
  *stem = path.substr(0, path.size() - L);
  *part = a;
  *count = b;
  return true;
}

std::string split_path(const std::string& stem, int part, int count) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "-%05d-of-%05d.gguf", part, count);
  return stem + buf;
}

}  // namespace

bool ggml_type_block(uint32_t type, int64_t* block_elems, int64_t* block_bytes) {
  const TypeInfo* i = type_info(type);
  if (!i) return false;
  *block_elems = i->block_elems;
  *block_bytes = i->block_bytes;
  return true;
}

std::string ggml_type_name(uint32_t type) {
  const TypeInfo* i = type_info(type);
  return i ? i->name : "type " + std::to_string(type);
}

bool GgufValue::is_int() const {
  switch (type) {
    case GgufValueType::F32: case GgufValueType::F64: case GgufValueType::String: case GgufValueType::Array:
      return false;
    default:
      return true;
  }
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

bool is_gguf_path(const std::string& path) { return ends_with(path, ".gguf"); }

GgufFile::GgufFile(const std::string& path) : file_(path) {
  const std::string& p = file_.path();
  Cursor c{file_.data(), file_.size(), 0, p};
  if (file_.size() < 4 || std::memcmp(file_.data(), "GGUF", 4) != 0)
    fail(p + ": not a GGUF file (the first 4 bytes are not 'GGUF')");
  c.at = 4;
  const uint32_t version = c.read<uint32_t>("version");
  if (version != 3)
    fail(p + ": GGUF version " + std::to_string(version) + " is not supported (flashmoe reads version 3)");
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  if (n_tensors > kMaxCount || n_kv > kMaxCount || n_tensors > file_.size() || n_kv > file_.size())
    fail(p + ": corrupt GGUF header (" + std::to_string(n_tensors) + " tensors, " + std::to_string(n_kv) +
         " metadata entries in a file of " + std::to_string(file_.size()) + " bytes)");

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key = c.str("metadata key " + std::to_string(k));
    const uint32_t t = c.read<uint32_t>("type of '" + key + "'");
    if (!valid_value_type(t)) fail(p + ": metadata '" + key + "' has unknown value type " + std::to_string(t));
    GgufValue v;
    read_value(c, GgufValueType(t), key, &v, 0);
    if (!kv_.emplace(key, std::move(v)).second) fail(p + ": metadata key '" + key + "' appears twice");
  }

  uint64_t alignment = 32;
  if (auto it = kv_.find("general.alignment"); it != kv_.end()) {
    if (!it->second.is_int() || it->second.i <= 0 || (it->second.i & (it->second.i - 1)) != 0)
      fail(p + ": general.alignment must be a power of two");
    alignment = uint64_t(it->second.i);
  }

  struct Info {
    uint64_t offset;
  };
  std::vector<Info> offsets;
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor t;
    t.name = c.str("name of tensor " + std::to_string(k));
    auto bad = [&](const std::string& why) { fail(p + ": tensor '" + t.name + "': " + why); };
    const uint32_t nd = c.read<uint32_t>("dimension count of '" + t.name + "'");
    if (nd == 0 || nd > kMaxDims) bad(std::to_string(nd) + " dimensions (1 to 4 expected)");
    uint64_t numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t dim = c.read<uint64_t>("shape of '" + t.name + "'");
      if (dim > (uint64_t(1) << 40)) bad("dimension " + std::to_string(dim) + " is too large");
      if (dim != 0 && numel > (uint64_t(1) << 50) / dim) bad("shape is too large");
      numel *= dim;
      t.ne.push_back(int64_t(dim));
    }
    t.type = c.read<uint32_t>("type of '" + t.name + "'");
    int64_t be = 0, bb = 0;
    if (!ggml_type_block(t.type, &be, &bb)) bad("unknown tensor type " + std::to_string(t.type));
    if (t.ne[0] % be != 0)
      bad("row of " + std::to_string(t.ne[0]) + " elements is not a whole number of " + ggml_type_name(t.type) +
          " blocks (" + std::to_string(be) + " each)");
    t.nbytes = numel / uint64_t(be) * uint64_t(bb);
    const uint64_t off = c.read<uint64_t>("offset of '" + t.name + "'");
    if (off % alignment != 0) bad("data offset " + std::to_string(off) + " is not aligned to " + std::to_string(alignment));
    offsets.push_back({off});
    tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = (c.at + alignment - 1) / alignment * alignment;
  if (data_start > file_.size() && n_tensors > 0)
    fail(p + ": truncated GGUF file (tensor data would start at byte " + std::to_string(data_start) +
         ", file is " + std::to_string(file_.size()) + " bytes)");
  const uint64_t data_size = n_tensors > 0 ? file_.size() - data_start : 0;
  std::map<std::string, int> seen;
  for (size_t k = 0; k < tensors_.size(); ++k) {
    GgufTensor& t = tensors_[k];
    const uint64_t off = offsets[k].offset;
    if (off > data_size || t.nbytes > data_size - off)
      fail(p + ": tensor '" + t.name + "': data [" + std::to_string(off) + ", " + std::to_string(off + t.nbytes) +
           ") lies outside the file (data section is " + std::to_string(data_size) +
           " bytes): truncated or corrupt file");
    if (!seen.emplace(t.name, 0).second) fail(p + ": tensor '" + t.name + "' appears twice");
    t.data = file_.data() + data_start + off;
    t.file = &file_.path();
  }
}

GgufModel::GgufModel(const std::string& path) : path_(path) {
  if (!file_exists(path)) fail("model file not found: " + path);
  files_.push_back(std::make_unique<GgufFile>(path));
  const GgufValue* sc = find("split.count");
  int64_t count = 1;
  if (sc) {
    if (!sc->is_int() || sc->i < 1 || sc->i > 99999) fail(path + ": split.count must be between 1 and 99999");
    count = sc->i;
  }
  std::string stem;
  int part = 0, name_count = 0;
  const bool named = split_name(path, &stem, &part, &name_count);
  if (count > 1) {
    if (!named || name_count != count)
      fail(path + ": the file is part of a " + std::to_string(count) +
           "-part split model, but its name does not end in " + split_path("", 1, int(count)));
    const GgufValue* no = find("split.no");
    if (part != 1 || (no && no->is_int() && no->i != 0))
      fail(path + ": this is part " + std::to_string(part) + " of a split model; give the first part, " +
           split_path(stem, 1, int(count)));
    for (int k = 2; k <= count; ++k) {
      const std::string sp = split_path(stem, k, int(count));
      if (!file_exists(sp)) fail(path + ": part " + std::to_string(k) + " of the split model is missing: " + sp);
      files_.push_back(std::make_unique<GgufFile>(sp));
    }
  }
  for (const auto& f : files_)
    for (const GgufTensor& t : f->tensors())
      if (!tensors_.emplace(t.name, &t).second)
        fail(f->path() + ": tensor '" + t.name + "' also appears in another part of the split model");
}

const GgufValue* GgufModel::find(const std::string& key) const {
  auto it = meta().find(key);
  return it == meta().end() ? nullptr : &it->second;
}

const GgufValue& GgufModel::get(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) fail(path_ + ": GGUF metadata has no '" + key + "'");
  return *v;
}

int64_t GgufModel::get_int(const std::string& key) const {
  const GgufValue& v = get(key);
  if (!v.is_int()) fail(path_ + ": GGUF metadata '" + key + "' must be an integer, not " + value_type_name(v.type));
  return v.i;
}

int64_t GgufModel::get_int(const std::string& key, int64_t def) const { return has(key) ? get_int(key) : def; }

double GgufModel::get_float(const std::string& key, double def) const {
  const GgufValue* v = find(key);
  if (!v) return def;
  if (!v->is_number()) fail(path_ + ": GGUF metadata '" + key + "' must be a number, not " + value_type_name(v->type));
  return v->is_int() ? double(v->i) : v->f;
}

std::string GgufModel::get_string(const std::string& key) const {
  const GgufValue& v = get(key);
  if (v.type != GgufValueType::String)
    fail(path_ + ": GGUF metadata '" + key + "' must be a string, not " + value_type_name(v.type));
  return v.s;
}

const GgufTensor* GgufModel::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

uint64_t GgufModel::total_bytes() const {
  uint64_t n = 0;
  for (const auto& kv : tensors_) n += kv.second->nbytes;
  return n;
}

}  // namespace flashmoe
