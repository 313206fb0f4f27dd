// Where the parts of a model live. `-m` may name the HF model directory
// itself (config.json + safetensors) or a bundle directory holding it as
// model/ next to tokenizer.json and tokenizer_config.json (as models/coder-mini).
#pragma once
#include <string>

namespace flashmoe {

struct ModelFiles {
  std::string model_dir;          // holds config.json
  std::string tokenizer_json;     // "" when none was found
  std::string tokenizer_config;   // "" when none was found
  std::string generation_config;  // "" when none was found
};

// Throws Error naming the path when no config.json can be found.
ModelFiles resolve_model_files(const std::string& path);

}  // namespace flashmoe
