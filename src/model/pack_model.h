// `flashmoe pack`: rewrites an HF checkpoint into the streaming layout
// (experts/pack.h writes it; this loads the checkpoint's experts for it).
#pragma once
#include <string>

#include "experts/pack.h"

namespace flashmoe {

// Writes into OUT.tmp-XXXXXX and renames it to `out` only when complete, so a
// crash never leaves a directory that looks like a valid packed model.
// Throws Error if `out` exists or anything cannot be read or written.
void pack_model(const std::string& in, const std::string& out, const PackOptions& opt,
                const PackProgress& progress = nullptr);

}  // namespace flashmoe
