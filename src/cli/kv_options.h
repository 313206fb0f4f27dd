// The KV cache options shared by every command that runs the model
// (logits, generate, run, chat) and by kv-calc.
//
//   add_kv_options(cmd, &cfg);   // before parsing
//   ... app.parse() ...
//   finalize_kv_options(&cfg);   // in the command's callback: presets + validation
#pragma once
#include <CLI/CLI.hpp>

#include "kv/kv_config.h"

namespace flashmoe::cli {

// --kv-dtype f32|bf16|f16|fp8, --kv-fp8-scale position|head, --kv-window W,
// --kv-h2o B, --kv-tova B, --kv-sinks N, --kv-recent F, --kv-streaming W,
// --kv-resident N, --kv-page P, --kv-page-select head|layer.
void add_kv_options(CLI::App* cmd, KvConfig* cfg);
// Applies presets and validates; throws flashmoe::Error on a bad combination.
void finalize_kv_options(KvConfig* cfg);

}  // namespace flashmoe::cli
