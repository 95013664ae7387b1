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

}  // namespace ds::cuda
