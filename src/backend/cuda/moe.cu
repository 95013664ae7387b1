// Placeholder until the MoE kernels land: fails loudly.
#include "backend/cuda/moe.cuh"
#include "core/error.h"

namespace ds::cuda {

void moe_route(const Context&, const TensorView&, const MoeRouteParams&, TensorView, TensorView) {
  throw UnsupportedError("cuda: MoE routing is not implemented yet");
}

void moe_ffn(const Context&, const MoeFfnParams&) {
  throw UnsupportedError("cuda: MoE experts are not implemented yet");
}

}  // namespace ds::cuda
