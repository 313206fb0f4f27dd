// The CPU forward pass: walks the model's layer plan over one step's tokens,
// of one sequence or of several (continuous batching).
#pragma once
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "model/logits_mode.h"
#include "model/model_state.h"
#include "model/qwen_model.h"

namespace flashmoe::cpu {

// One sequence's part of a batched call: n tokens fed to `state`, logits as
// forward() gives them (All: [n, vocab]; Last: [vocab]; None: nothing).
struct SequenceInput {
  ModelState* state = nullptr;
  const int32_t* ids = nullptr;
  int64_t n = 0;
  LogitsMode mode = LogitsMode::Last;
  float* logits = nullptr;
};

// Feeds every item's tokens to its state in steps whose activations stack
// the items' rows (up to 256 tokens of each item per step), so every
// projection, the router and the experts read their weights once per step
// for the whole batch; attention, the conv and the delta rule run on each
// item's own state. Each item's result is bit-identical to feeding it
// alone. All ids are checked first (check_token_ids: Error before any state
// is touched); states must be distinct (Error otherwise).
void forward_batch(const QwenModel& m, const SequenceInput* items, int64_t count, ThreadPool& pool);

// The batch of one. hidden: when non-null, receives the residual stream
// after each layer for these tokens ([L+1][n*H]: index 0 = embeddings, i =
// after layer i), a debug aid used by `flashmoe logits --hidden` and the
// golden tests.
void forward(const QwenModel& m, ModelState& st, const int32_t* ids, int64_t n, LogitsMode mode, float* logits,
             ThreadPool& pool, std::vector<std::vector<float>>* hidden = nullptr);

}  // namespace flashmoe::cpu
