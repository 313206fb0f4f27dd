// The multi-token-prediction head on the CPU: keeping its KV cache in step
// with the main model (forward.cpp calls advance_mtp for a drafting state)
// and drafting tokens with it.
#pragma once
#include <cstdint>
#include <functional>

#include "core/thread_pool.h"
#include "model/model_state.h"
#include "model/qwen_model.h"

namespace flashmoe::cpu {

// After the main model consumed ids[0, n) from position pos0 with final-normed
// hidden states hidden[n, H]: appends the MTP cache entries those tokens
// complete (entry pos0-1 from st.mtp_hidden and ids[0], then entry pos0+t-1
// from hidden[t-1] and ids[t]) and keeps hidden[n-1] as st.mtp_hidden. Only
// the layer's attention runs: nothing later reads the rest of an entry.
void advance_mtp(const QwenModel& m, ModelState& st, int64_t pos0, const int32_t* ids, int64_t n,
                 const float* hidden, ThreadPool& pool);

// Picks draft token `step` (0-based) from the head's logits [vocab].
using DraftPicker = std::function<int32_t(const float* logits, int64_t step)>;

// Drafts n tokens after `next` (the token chosen from the state's last
// logits, not yet consumed): each step runs the head on (the previous
// step's output, or st.mtp_hidden; the previous token) and asks `pick`.
// Works on a copy of the head's KV cache: st is unchanged.
void mtp_draft(const QwenModel& m, const ModelState& st, int32_t next, int64_t n, const DraftPicker& pick,
               int32_t* drafted, ThreadPool& pool);

}  // namespace flashmoe::cpu
