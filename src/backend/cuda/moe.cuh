// MoE launchers: routing (softmax + greedy / group-limited top-k) and the routed experts.
#pragma once

#include "backend/backend.h"
#include "backend/cuda/context.cuh"

namespace ds::cuda {

// Semantics of Backend::moe_route (backend.h).
void moe_route(const Context& ctx, const TensorView& logits, const MoeRouteParams& p,
               TensorView ids, TensorView weights);

// Semantics of Backend::moe_ffn (backend.h). Keeps per-expert pointer tables on the device,
// keyed by p.experts.data().
void moe_ffn(const Context& ctx, const MoeFfnParams& p);

}  // namespace ds::cuda
