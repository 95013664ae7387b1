// RMSNorm over rows.
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.h"

namespace ds::cuda {

struct RmsNormArgs {
  TensorView x;  // [rows, n] F32, leading dims may be strided
  TensorView w;  // [n] F32
  float eps = 1e-6f;
  TensorView out;  // [rows, n] F32; may be x itself (or residual)
  // Optional [rows, n] F32: x += residual first (written back to x), as Backend::add_rms_norm.
  TensorView residual;
};

// out = x / sqrt(mean(x^2) + eps) * w per row, the sum of squares in F32.
void launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream);

}  // namespace ds::cuda
