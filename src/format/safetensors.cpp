#include "format/safetensors.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace flashmoe {

using nlohmann::json;

namespace {
// No real header is anywhere near this; a larger value means a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 512ull << 20;
}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const std::string& p = file_.path();
  if (file_.size() < 8) fail(p + ": truncated safetensors file (" + std::to_string(file_.size()) +
                             " bytes, no header)");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | file_.data()[i];
  if (hlen > kMaxHeaderBytes || hlen > file_.size() - 8)
    fail(p + ": truncated or corrupt safetensors file (header length " + std::to_string(hlen) +
         " exceeds file size " + std::to_string(file_.size()) + ")");
  json header;
  try {
    header = json::parse(file_.data() + 8, file_.data() + 8 + hlen);
  } catch (const json::exception& e) {
    fail(p + ": safetensors header is not valid JSON (" + e.what() + ")");
  }
  if (!header.is_object()) fail(p + ": safetensors header is not a JSON object");
  data_base_ = file_.data() + 8 + hlen;
  const uint64_t data_size = file_.size() - 8 - hlen;

  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const json& v = it.value();
    auto bad = [&](const std::string& why) { fail(p + ": tensor '" + name + "': " + why); };
    if (!v.is_object()) bad("header entry is not an object");
    Entry e;
    if (!v.contains("dtype") || !v["dtype"].is_string()) bad("missing dtype");
    e.dtype_str = v["dtype"].get<std::string>();
    e.dtype_known = dtype_from_safetensors(e.dtype_str, &e.dtype);
    if (!v.contains("shape") || !v["shape"].is_array()) bad("missing shape");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) bad("shape has a non-integer or negative dimension");
      uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > (uint64_t(1) << 62) / dim) bad("shape is too large");
      numel *= dim;
      e.shape.push_back(int64_t(dim));
    }
    const json& off = v.contains("data_offsets") ? v["data_offsets"] : json();
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad("data_offsets must be two non-negative integers");
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en) bad("data_offsets begin > end");
    if (en > data_size)
      bad("data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
          ") point outside the file (data section is " + std::to_string(data_size) +
          " bytes): truncated or corrupt file");
    if (e.dtype_known && en - b != numel * dtype_size(e.dtype))
      bad("data size " + std::to_string(en - b) + " bytes does not match dtype " + e.dtype_str +
          " and shape " + shape_to_string(e.shape));
    e.begin = size_t(b);
    e.end = size_t(en);
    entries_.emplace(name, std::move(e));
  }
}

TensorView SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) fail(path() + ": no tensor named '" + name + "'");
  const Entry& e = it->second;
  if (!e.dtype_known)
    fail(path() + ": tensor '" + name + "' has dtype " + e.dtype_str +
         ", which flashmoe does not support");
  TensorView t;
  t.name = name;
  t.dtype = e.dtype;
  t.shape = e.shape;
  t.data = data_base_ + e.begin;
  return t;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& kv : entries_) out.push_back(kv.first);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    uint64_t n = dtype_size(t.dtype);
    for (int64_t d : t.shape) n *= uint64_t(d);
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape},
                      {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h += ' ';  // keep the data section 8-byte aligned
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("cannot write " + path + ": " + errno_text(errno));
  // The first failure's errno is kept: later calls (and the clean-up) may change errno.
  int err = 0;
  auto put = [&](const void* p, size_t n) {
    errno = 0;
    if (!err && std::fwrite(p, 1, n, f) != n) err = errno ? errno : EIO;
  };
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(h.size()) >> (8 * i));
  put(len, 8);
  put(h.data(), h.size());
  for (const auto& t : tensors) {
    size_t n = dtype_size(t.dtype);
    for (int64_t d : t.shape) n *= size_t(d);
    put(t.data, n);
  }
  if (!err && std::fflush(f) != 0) err = errno ? errno : EIO;
  if (!err && ::fsync(::fileno(f)) != 0 && errno != EINVAL) err = errno;  // a full disk may only show here
  if (std::fclose(f) != 0 && !err) err = errno ? errno : EIO;
  if (!err && std::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err) {
    std::remove(tmp.c_str());
    fail("cannot write " + path + ": " + errno_text(err));
  }
}

}  // namespace flashmoe
