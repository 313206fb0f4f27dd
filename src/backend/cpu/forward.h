// The CPU forward pass: walks the model's layer plan over chunks of tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "model/logits_mode.h"
#include "model/model_state.h"
#include "model/qwen_model.h"

namespace flashmoe::cpu {

// Feeds n tokens to `st` (a state from m.new_state), advancing it. The ids
// are checked first (check_token_ids: Error before the state is touched);
// prompts run in chunks of 256 tokens. With LogitsMode::All, logits receives
// [n, vocab]; with Last, [vocab] for the last token; with None, nothing.
// hidden: when non-null, receives the residual stream after each layer for
// these tokens ([L+1][n*H]: index 0 = embeddings, i = after layer i), a debug
// aid used by `flashmoe logits --hidden` and the golden tests.
void forward(const QwenModel& m, ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
             ThreadPool& pool, std::vector<std::vector<float>>* hidden = nullptr);

}  // namespace flashmoe::cpu
