// Rotary position embedding, in place, with precomputed per-pair inverse frequencies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"

namespace ds::cuda {

struct RopeArgs {
  TensorView x;                        // [T, heads, head_dim] F32, strided in T and heads
  const int32_t* positions = nullptr;  // [T] device
  const float* inv_freq = nullptr;     // [rotary_dim / 2] device, from ds::rope_inv_freq
  int rotary_dim = 0;                  // leading dims of each head that rotate
  RopeStyle style = RopeStyle::RotateHalf;
  float attn_factor = 1.0f;  // scales cos and sin
};

// Angle of pair i at position p: float(p) * inv_freq[i], as the CPU backend computes it.
void launch_rope(const RopeArgs& a, cudaStream_t stream);

#ifdef __CUDACC__
// cos and sin (times attn_factor) of a pair with inverse frequency inv_freq at position pos.
// Shared by every kernel that rotates, with explicit roundings, so fused kernels give the rope
// op's bits; the rotation rounds like the CPU backend's (no fused multiply-add).
__device__ __forceinline__ void rope_cos_sin(int32_t pos, float inv_freq, float attn_factor,
                                             float& c, float& s) {
  float sn, cn;
  sincosf(__fmul_rn(float(pos), inv_freq), &sn, &cn);
  c = __fmul_rn(cn, attn_factor);
  s = __fmul_rn(sn, attn_factor);
}
__device__ __forceinline__ void rope_rotate(float& x0, float& x1, float c, float s) {
  const float r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  const float r1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  x0 = r0;
  x1 = r1;
}
#endif

}  // namespace ds::cuda
