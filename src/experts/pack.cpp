#include "experts/pack.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/xxhash64.h"
#include "experts/manifest.h"
#include "experts/quantize.h"
#include "format/checkpoint.h"
#include "format/config.h"
#include "format/safetensors.h"

namespace flashmoe {

void write_all(int fd, const void* p, size_t n, uint64_t off, const std::string& path) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, b, n, off_t(off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("cannot write " + path + ": " + errno_text(w == 0 ? ENOSPC : errno));
    b += w, n -= size_t(w), off += uint64_t(w);
  }
}

void write_text(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write " + path + ": " + errno_text(errno));
  try {
    write_all(fd, text.data(), text.size(), 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  // Delayed allocation reports a full disk only here (or at close).
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    fail("cannot write " + path + ": " + errno_text(e));
  }
  if (::close(fd) != 0) fail("cannot write " + path + ": " + errno_text(errno));
}

void remove_tree(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      std::string p = dir + "/" + n;
      if (is_directory(p)) remove_tree(p);
      else ::unlink(p.c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

void build_packed_dir(const std::string& out, const std::function<void(const std::string& tmp)>& fill) {
  std::string tmpl = out + ".tmp-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) fail("cannot create a directory next to " + out + ": " + errno_text(errno));
  const std::string tmp(buf.data());
  try {
    if (::mkdir((tmp + "/experts").c_str(), 0755) != 0) fail("cannot create " + tmp + "/experts: " + errno_text(errno));
    fill(tmp);
    if (int dfd = ::open(tmp.c_str(), O_RDONLY | O_DIRECTORY); dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
    ::chmod(tmp.c_str(), 0755);  // mkdtemp makes it private
    if (::rename(tmp.c_str(), out.c_str()) != 0) fail("cannot rename " + tmp + " to " + out + ": " + errno_text(errno));
  } catch (const Error& e) {
    remove_tree(tmp);
    fail(std::string(e.what()) + "; pack stopped, " + out + " was not created");
  } catch (...) {
    remove_tree(tmp);
    throw;
  }
}

std::vector<PackedLayer> write_layer_files(
    const ModelConfig& cfg, const std::string& tmp, const PackProgress& progress,
    const std::function<void(int64_t layer, const std::string& path, PackedLayer* pl)>& write) {
  std::vector<PackedLayer> layers;
  int64_t moe_layers = 0, done = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) moe_layers += cfg.layer_is_moe[size_t(i)] ? 1 : 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    if (!cfg.layer_is_moe[size_t(i)]) continue;
    char name[64];
    std::snprintf(name, sizeof name, "experts/layer-%03lld.bin", static_cast<long long>(i));
    PackedLayer pl;
    pl.layer = i;
    pl.file = name;
    write(i, tmp + "/" + name, &pl);
    layers.push_back(std::move(pl));
    if (progress) progress(++done, moe_layers);
  }
  return layers;
}

namespace {

// Files besides the weights that a model directory carries (config, tokenizer,
// generation defaults); copied as they are.
std::vector<std::string> side_files(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n == "." || n == ".." || is_directory(dir + "/" + n)) continue;
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) continue;
      if (n == "model.safetensors.index.json") continue;
      out.push_back(n);
    }
    ::closedir(d);
  }
  return out;
}

void check_stop(const PackOptions& opt) {
  if (opt.stop && *opt.stop) fail("interrupted by a signal");
}

void write_expert_layer(const std::string& path, const std::vector<FfnExpert>& experts, const ExpertLayout& layout,
                        const PackOptions& opt, PackedLayer* pl) {
  write_expert_records(path, layout, int64_t(experts.size()), opt, pl, [&](int64_t i, uint8_t* rec) {
    const FfnExpert& e = experts[size_t(i)];
    std::fill(rec, rec + layout.bytes, uint8_t(0));
    const std::pair<const Matrix*, const ExpertPart*> parts[3] = {{&e.gate, &layout.gate}, {&e.up, &layout.up}, {&e.down, &layout.down}};
    for (const auto& [m, part] : parts) {
      if (layout.quant == QuantKind::Fp8Block) {  // codes and block scales as stored
        std::memcpy(rec + part->offset, m->data, part->bytes);
        std::memcpy(rec + part->scales, m->block_scales, m->block_scale_bytes());
        continue;
      }
      QuantizedMatrix q = quantize_matrix(*m, opt.experts, opt.group);
      std::memcpy(rec + part->offset, q.data.data(), part->bytes);
      if (opt.experts != QuantKind::None) {
        std::memcpy(rec + part->scales, q.scales.data(), q.scales.size() * 2);
        std::memcpy(rec + part->biases, q.biases.data(), q.biases.size() * 2);
      }
    }
  });
}

}  // namespace

void write_expert_records(const std::string& path, const ExpertLayout& layout, int64_t count, const PackOptions& opt,
                          PackedLayer* pl, const std::function<void(int64_t i, uint8_t* rec)>& fill) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write " + path + ": " + errno_text(errno));
  std::vector<uint8_t> rec(layout.bytes);
  uint64_t at = 0;
  try {
    for (int64_t i = 0; i < count; ++i) {
      check_stop(opt);
      fill(i, rec.data());
      write_all(fd, rec.data(), rec.size(), at, path);
      pl->experts.push_back(PackedExpert{at, layout.bytes, xxhash64(rec.data(), rec.size())});
      at = align_up(at + layout.bytes, kExpertAlign);
    }
    // Pad to whole pages so an O_DIRECT read of the last expert stays inside the file.
    if (::ftruncate(fd, off_t(at)) != 0) fail("cannot write " + path + ": " + errno_text(errno));
    if (::fsync(fd) != 0) fail("cannot write " + path + ": " + errno_text(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) fail("cannot write " + path + ": " + errno_text(errno));
  pl->file_bytes = at;
}

void write_packed_model(const std::string& in, const Checkpoint& ck, const ModelConfig& cfg,
                        const LayerExperts& experts, const std::string& out, const PackOptions& opt,
                        const PackProgress& progress) {
  ExpertLayout layout;
  if (opt.experts == QuantKind::Fp8Block) {
    // FP8 experts are copied as they are: every expert must be FP8 with the
    // same blocks, each matrix starting on a block row.
    const FfnExpert* first = nullptr;
    for (int64_t i = 0; i < cfg.num_layers && !first; ++i)
      if (cfg.layer_is_moe[i] && !experts(i).empty()) first = &experts(i)[0];
    if (!first || !first->gate.fp8())
      fail("--experts fp8 keeps FP8 experts as they are stored, and this checkpoint's experts are " +
           std::string(first && first->gate.quantized() ? quant_name(first->gate.quant) : "floats") +
           " (pick bf16, q8 or q4)");
    layout = ExpertLayout::make(cfg.hidden_size, cfg.moe_intermediate, opt.experts, first->gate.group, first->gate.block_rows);
    for (int64_t i = 0; i < cfg.num_layers; ++i) {
      if (!cfg.layer_is_moe[i]) continue;
      for (const FfnExpert& e : experts(i))
        for (const Matrix* m : {&e.gate, &e.up, &e.down})
          if (!m->fp8() || m->group != layout.group || m->block_rows != layout.block_rows || m->block_row0 != 0)
            fail("--experts fp8: layer " + std::to_string(i) +
                 " has an expert that is not FP8 in whole blocks of the first expert's size (pick bf16, q8 or q4)");
    }
  } else {
    layout = ExpertLayout::make(cfg.hidden_size, cfg.moe_intermediate, opt.experts, opt.group);
  }

  build_packed_dir(out, [&](const std::string& tmp) {
    check_stop(opt);
    // Non-expert weights, byte for byte under their original names.
    std::vector<TensorToWrite> rest;
    for (const std::string& name : ck.tensor_names()) {
      if (name.find(".mlp.experts.") != std::string::npos || name.find(".mlp.switch_mlp.") != std::string::npos) continue;
      TensorView t = ck.get("/" + name);
      rest.push_back({name, t.dtype, t.shape, t.data});
    }
    write_safetensors(tmp + "/model.safetensors", rest);
    for (const std::string& f : side_files(in)) write_text(tmp + "/" + f, read_text_file(in + "/" + f));
    for (const std::string& f : opt.extra_files) {
      const std::string base = f.substr(f.find_last_of('/') + 1);
      if (!file_exists(tmp + "/" + base)) write_text(tmp + "/" + base, read_text_file(f));
    }

    PackedManifest m;
    m.layout = layout;
    m.layers = write_layer_files(cfg, tmp, progress, [&](int64_t i, const std::string& path, PackedLayer* pl) {
      write_expert_layer(path, experts(i), layout, opt, pl);
    });
    check_stop(opt);
    // The manifest last: a directory without one is never taken for a packed model.
    write_text(tmp + "/" + kManifestName, manifest_to_json(m, read_text_file(in + "/config.json")));
  });
}

}  // namespace flashmoe
