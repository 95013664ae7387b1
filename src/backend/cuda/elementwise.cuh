// Elementwise F32 kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace ds::cuda {

// x[i] += y[i] for i < n.
void launch_add_f32(float* x, const float* y, int64_t n, cudaStream_t stream);

}  // namespace ds::cuda
