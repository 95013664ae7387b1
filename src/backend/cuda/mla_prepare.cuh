// The MLA layer's latent norm, rope of q and k, and latent cache store in one kernel
// (Backend::mla_prepare), bit-identical to rms_norm, rope, rope and store_kv in turn.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/common.cuh"

namespace ds::cuda {

struct MlaPrepareArgs {
  TensorView kva;               // [T, R + P] F32, rows may be strided; updated in place
  const float* norm = nullptr;  // [R] device
  float eps = 1e-6f;
  TensorView q_rope;                   // [T, H, P'] F32, strided in T and heads; rotated in place
  const int32_t* positions = nullptr;  // [T] device
  const float* inv_freq = nullptr;     // [rotary_dim / 2] device, from ds::rope_inv_freq
  int rotary_dim = 0;
  RopeStyle style = RopeStyle::RotateHalf;
  float attn_factor = 1.0f;
  PagedKv cache;  // latent cache (kv_heads 1, head_dim R + P): F32, F16 or BF16
  int kv_lora_rank = 0;
  const int32_t* slot_mapping = nullptr;  // [num_tokens] device
  int num_tokens = 0;                     // rows stored (<= T); every row is normalized and rotated
  DeviceErrors* errors = nullptr;         // a slot outside the cache sets bad_slot
};

// Whether the fused kernel takes this cache dtype (FP8 caches use the four ops).
bool mla_prepare_supported(DType cache_dtype);

void launch_mla_prepare(const MlaPrepareArgs& a, cudaStream_t stream);

}  // namespace ds::cuda
