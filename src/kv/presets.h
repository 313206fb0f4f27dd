// Hand-built ModelConfigs of the published Qwen3.5 / Qwen3-Next checkpoints
// (docs/MODEL.md), for sizing without a config.json at hand.
#pragma once
#include <string>
#include <vector>

#include "format/config.h"

namespace flashmoe {

// qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, qwen3-next-80b-a3b.
std::vector<std::string> model_preset_names();
// Throws Error naming the accepted presets for an unknown name.
ModelConfig model_preset(const std::string& name);

}  // namespace flashmoe
