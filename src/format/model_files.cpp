#include "format/model_files.h"

#include "core/error.h"
#include "core/mapped_file.h"
#include "format/gguf.h"

namespace flashmoe {

namespace {
std::string first_existing(std::initializer_list<std::string> candidates) {
  for (const auto& c : candidates)
    if (file_exists(c)) return c;
  return "";
}
}  // namespace

ModelFiles resolve_model_files(const std::string& path) {
  if (is_gguf_path(path) && !is_directory(path)) {
    // A GGUF file carries its own tokenizer and chat template.
    if (!file_exists(path)) fail("model file not found: " + path);
    ModelFiles f;
    f.model_dir = path;
    f.gguf = path;
    return f;
  }
  if (!is_directory(path)) fail("model directory not found: " + path);
  ModelFiles f;
  if (file_exists(path + "/config.json")) f.model_dir = path;
  else if (file_exists(path + "/model/config.json")) f.model_dir = path + "/model";
  else fail("no config.json in " + path + " nor in " + path + "/model (give the model directory, or the bundle above its model/ folder)");
  const std::string& m = f.model_dir;
  f.tokenizer_json = first_existing({m + "/tokenizer.json", path + "/tokenizer.json", m + "/../tokenizer.json"});
  f.tokenizer_config = first_existing({m + "/tokenizer_config.json", path + "/tokenizer_config.json",
                                       m + "/../tokenizer_config.json"});
  f.generation_config = first_existing({m + "/generation_config.json", path + "/generation_config.json"});
  return f;
}

}  // namespace flashmoe
