// The writer of a packed model directory (the streaming layout): per MoE
// layer one file of experts (each expert one aligned record, optionally
// quantised), the other weights in model.safetensors, and the manifest.
// `flashmoe pack` reaches it through pack_model (model/pack_model.h), which
// loads the checkpoint's experts.
#pragma once
#include <csignal>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/matrix.h"
#include "experts/ffn_expert.h"
#include "format/checkpoint.h"
#include "format/config.h"

namespace flashmoe {

struct PackOptions {
  QuantKind experts = QuantKind::None;  // None: bf16
  int32_t group = 64;
  // Files from elsewhere to carry along (e.g. a bundle's tokenizer.json that
  // sits beside the model directory); copied under their base names.
  std::vector<std::string> extra_files;
  // Set (non-zero) by a signal handler to stop: the pack stops at its next
  // expert, removes what it wrote and fails with "interrupted".
  const volatile std::sig_atomic_t* stop = nullptr;
};

// pwrite()s all n bytes of p at offset `off` of fd; throws Error naming `path`.
void write_all(int fd, const void* p, size_t n, uint64_t off, const std::string& path);
// Writes `text` to `path` and fsyncs it; throws Error naming the file.
void write_text(const std::string& path, const std::string& text);
// Removes `dir` and everything under it (a failed pack's temporary directory).
void remove_tree(const std::string& dir);

struct ExpertLayout;
struct PackedLayer;
// Writes `count` expert records of `layout` to the layer file `path` (each
// filled by fill(i, record) and aligned as the manifest expects), recording
// offsets and hashes in *pl; stops at opt.stop. pack and pack --synthetic.
void write_expert_records(const std::string& path, const ExpertLayout& layout, int64_t count, const PackOptions& opt,
                          PackedLayer* pl, const std::function<void(int64_t i, uint8_t* rec)>& fill);

// progress(done, total) is called after each expert layer.
using PackProgress = std::function<void(int64_t done, int64_t total)>;

// A packed model's directory `out`, made all or nothing (pack and pack
// --synthetic): fill(tmp) writes the model into a private directory beside
// `out` (its experts/ subdirectory made), the manifest last; that directory
// is then synced, opened to all and renamed to `out`. On any error it is
// removed and the Error's text ends "; pack stopped, OUT was not created".
void build_packed_dir(const std::string& out, const std::function<void(const std::string& tmp)>& fill);

// The experts' file of each MoE layer of `cfg`, in layer order, named as the
// manifest expects under `tmp` and written by write(layer, path, &pl);
// progress after each. Returns the manifest's layers.
std::vector<PackedLayer> write_layer_files(
    const ModelConfig& cfg, const std::string& tmp, const PackProgress& progress,
    const std::function<void(int64_t layer, const std::string& path, PackedLayer* pl)>& write);

// The routed experts of MoE layer `layer` ([E], in expert order).
using LayerExperts = std::function<const std::vector<FfnExpert>&(int64_t layer)>;

// Writes the packed form of the HF model directory `in` (its checkpoint `ck`,
// config `cfg`, the experts of each MoE layer from `experts`) into
// OUT.tmp-XXXXXX and renames it to `out` only when complete, so a crash never
// leaves a directory that looks like a valid packed model. Throws Error if the
// layout does not fit the options or anything cannot be read or written.
void write_packed_model(const std::string& in, const Checkpoint& ck, const ModelConfig& cfg,
                        const LayerExperts& experts, const std::string& out, const PackOptions& opt,
                        const PackProgress& progress = nullptr);

}  // namespace flashmoe
