// `flashmoe pack --synthetic PRESET`: a packed model (the streaming layout of
// experts/pack.h) of a published shape with random weights, written straight
// to disk one expert record at a time, so that streaming can be measured at
// a real model's record size (397B: 512 experts of 6.75 MiB per layer in q4)
// without its checkpoint and without holding a layer's experts in memory.
#pragma once
#include <string>

#include "experts/pack.h"
#include "format/config.h"

namespace flashmoe {

// config.json text (model_type qwen3_5_moe_text, bf16, tied embeddings) that
// parse_model_config reads back as `c`.
std::string synthetic_config_json(const ModelConfig& c);

// Writes OUT.tmp-XXXXXX and renames it to `out` when complete (as pack does).
// Non-expert weights: bf16 uniform in +-1/sqrt(fan-in), norms at identity,
// the embedding tied to the lm_head; experts: random codes (q8/q4; scales
// and biases spread them over the same range) or random bf16, each record
// with its xxh64 in the manifest. Throws Error if `out` exists or a write fails.
void pack_synthetic(const ModelConfig& c, const std::string& out, const PackOptions& opt,
                    const PackProgress& progress = nullptr);

// Bytes pack_synthetic writes for `c` (expert files + model.safetensors data).
uint64_t synthetic_pack_bytes(const ModelConfig& c, const PackOptions& opt);

}  // namespace flashmoe
