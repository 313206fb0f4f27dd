// The weights of a GGUF model (llama.cpp's tensor names: token_embd,
// blk.N.attn_qkv, blk.N.ffn_gate_exps, blk.N.ssm_a, ...) as the same
// ModelWeights an HF checkpoint gives, views into the mmapped file(s) in
// their stored type (F32 / F16 / BF16 or a ggml block format). Undoes what
// llama.cpp's converter changed: RMSNorm weights were stored as 1 + w (the
// linear-attention gated norm excepted), A_log as -exp(A_log), Qwen3-Next's
// grouped qkvz split into attn_qkv + attn_gate, and Qwen3.5's value heads
// reordered from grouped to tiled (LinearAttentionWeights::v_heads_tiled).
#pragma once
#include "format/config.h"
#include "format/gguf.h"
#include "model/weights.h"

namespace flashmoe {

// Every tensor is checked against `cfg` (shape, supported type); an error
// names the file, the tensor and what was expected.
ModelWeights load_gguf_weights(const GgufModel& g, const ModelConfig& cfg);

}  // namespace flashmoe
