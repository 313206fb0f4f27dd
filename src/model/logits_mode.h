// Which logits a forward pass writes; shared by every backend.
#pragma once

namespace flashmoe {

// None: no logits (a context only advances the state). Last: [vocab] for the
// last token. All: [n, vocab], one row per token fed.
enum class LogitsMode { None, Last, All };

}  // namespace flashmoe
