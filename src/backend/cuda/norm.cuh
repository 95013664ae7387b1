// RMSNorm over rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"

namespace ds::cuda {

struct RmsNormArgs {
  TensorView x;  // [rows, n] F32, leading dims may be strided
  TensorView w;  // [n] F32
  float eps = 1e-6f;
  TensorView out;  // [rows, n] F32; may be x itself (or residual)
  // Optional [rows, n] F32: x + residual first, written to x_out (x itself when x_out is empty),
  // and normalized from there, as Backend::add_rms_norm.
  TensorView residual;
  TensorView x_out;
};

// out = x / sqrt(mean(x^2) + eps) * w per row, the sum of squares in F32.
void launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream);

// Elements of a row a thread of the register-row norm kernels holds (DEEPSERVE_ROW_REGS=1):
// rows of up to kRowRegs * 1,024 take them (rms_norm's threads give ~4 a thread, 5 at V2.5's
// hidden 5,120); longer ones keep the loop.
constexpr int kRowRegs = 8;

// Threads per row launch_rms_norm uses for n columns (about 4 elements each); a fused kernel
// that sums a row's squares over this many threads and block_sum gets rms_norm's bits.
inline int rms_norm_threads(int64_t n) {
  const int64_t t = (n / 4 + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

#ifdef __CUDACC__
// The norm's float operations with explicit rounding, shared by every kernel that normalizes
// so fused versions cannot contract them differently.
__device__ __forceinline__ float rms_residual_add(float x, float y) {
  return __fadd_rn(x, y);
}
__device__ __forceinline__ float rms_add_square(float ss, float v) {
  return __fmaf_rn(v, v, ss);
}
__device__ __forceinline__ float rms_inv(float ss, int n, float eps) {
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(ss, float(n)), eps)));
}
__device__ __forceinline__ float rms_apply(float x, float inv, float w) {
  return __fmul_rn(__fmul_rn(x, inv), w);
}
#endif

}  // namespace ds::cuda
