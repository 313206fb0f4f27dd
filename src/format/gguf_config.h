// The ModelConfig of a GGUF model (archs qwen35moe, qwen35, qwen3next), read
// from its metadata ({arch}.block_count, .embedding_length, .ssm.*, ...) the
// way llama.cpp reads it, plus what only the tensors say (tied output,
// dense or MoE layer). The same fields config.json gives, so the rest of the
// engine cannot tell the two apart.
#pragma once
#include "format/config.h"
#include "format/gguf.h"

namespace flashmoe {

ModelConfig gguf_model_config(const GgufModel& g);

}  // namespace flashmoe
