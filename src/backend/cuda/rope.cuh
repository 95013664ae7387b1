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
// Rotates every head of one token's row in place: heads * half pairs spread over nt threads
// (this one is tid), with the cos / sin table cs_sn ([half] cos, then [half] sin).
__device__ __forceinline__ void rope_heads(char* row, int64_t stride_h, int heads, int half,
                                           bool adjacent, const float* cs_sn, int tid, int nt) {
  for (int j = tid; j < heads * half; j += nt) {
    const int h = j / half, i = j % half;
    float* v = reinterpret_cast<float*>(row + int64_t(h) * stride_h);
    const int a = adjacent ? 2 * i : i, b = adjacent ? 2 * i + 1 : i + half;
    float x0 = v[a], x1 = v[b];
    rope_rotate(x0, x1, cs_sn[i], cs_sn[half + i]);
    v[a] = x0;
    v[b] = x1;
  }
}
#endif

}  // namespace ds::cuda
