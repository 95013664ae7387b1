// Backend::fill_random on the device: dummy weights generated in place (never on the host),
// bit-identical to the host reference (random_fill.cpp), W4A16 quantized per group in place.
#pragma once

#include <cuda_runtime.h>

#include "backend/backend.h"

namespace ds::cuda {

void launch_fill_random(const TensorView& dst, const RandomFill& p, cudaStream_t stream);

}  // namespace ds::cuda
