// One feed-forward expert as views of its three matrices: what the expert
// store hands the MoE block, what a packed expert record decodes to, and
// (model/weights.h) the shared expert and the dense MLP of a layer.
#pragma once

#include "core/matrix.h"

namespace flashmoe {

struct FfnExpert {
  Matrix gate, up, down;  // [I, H], [I, H], [H, I]
};

}  // namespace flashmoe
