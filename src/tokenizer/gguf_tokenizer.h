// The tokenizer and chat template a GGUF carries (tokenizer.ggml.*,
// tokenizer.chat_template), turned into the tokenizer.json / tokenizer_config
// the HF model has, so encoding, decoding and rendering go through the same
// classes and give the same ids and text. Supports what llama.cpp's converter
// writes for Qwen models: tokenizer.ggml.model "gpt2" (byte-level BPE) with
// pre-tokenizer "qwen2" or "qwen35"; control tokens (type 3) become special
// added tokens, user-defined ones (type 4) non-special added tokens.
#pragma once
#include <optional>

#include "format/gguf.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe {

// Throws Error naming the file and key when the tokenizer is missing or of a
// kind flashmoe does not read.
Tokenizer gguf_tokenizer(const GgufModel& g);
// nullopt when the file has no tokenizer.chat_template.
std::optional<ChatTemplate> gguf_chat_template(const GgufModel& g);

// What `-m` names: a .gguf file, else what Tokenizer::load / ChatTemplate::load take.
Tokenizer load_tokenizer(const std::string& path);
ChatTemplate load_chat_template(const std::string& path);  // throws Error when the file has none

}  // namespace flashmoe
