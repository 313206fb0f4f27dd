// Sampling and generation-length options shared by run and chat (serve has its own).
#pragma once
#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "format/model_files.h"

namespace flashmoe::cli {

struct GenerationFlags {
  int n_predict = 256;
  int64_t ctx_size = 0;
  std::optional<float> temp, top_p, min_p, repeat_penalty;
  std::optional<int> top_k;
  float presence_penalty = 0, frequency_penalty = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;  // --ignore-eos: end-of-sequence tokens do not end the generation
  bool mtp = false;         // --mtp: speculative decoding with the model's MTP head
  std::optional<int> spec_draft;
};

// --mtp and --spec-draft (run, chat, generate); the default draft length.
constexpr int kDefaultSpecDraft = 2;
void add_speculative_options(CLI::App* cmd, bool* mtp, std::optional<int>* draft);
// The draft length --mtp / --spec-draft ask for (0: no speculation).
int spec_draft_from_flags(bool mtp, const std::optional<int>& draft);

void add_generation_options(CLI::App* cmd, GenerationFlags* f);

// Defaults come from generation_config.json (and the model's EOS ids); flags
// given on the command line win. `model_max_ctx` is the model's context.
GenerateOptions make_generate_options(const GenerationFlags& f, const ModelFiles& files,
                                      const std::vector<int32_t>& extra_eos, int64_t model_max_ctx);

}  // namespace flashmoe::cli
