// Where the parts of a model live. `-m` may name the HF model directory
// itself (config.json + safetensors) or a bundle directory holding it as
// model/ next to tokenizer.json and tokenizer_config.json (as models/coder-mini),
// or be a .gguf file (the first part of a split model), which holds all of it.
#pragma once
#include <string>

namespace flashmoe {

struct ModelFiles {
  std::string model_dir;          // holds config.json
  std::string tokenizer_json;     // "" when none was found
  std::string tokenizer_config;   // "" when none was found
  std::string generation_config;  // "" when none was found
  std::string gguf;               // the .gguf file when -m named one (model_dir is then that file too)
};

// Throws Error naming the path when no config.json can be found.
ModelFiles resolve_model_files(const std::string& path);

}  // namespace flashmoe
