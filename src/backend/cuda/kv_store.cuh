// Writes a step's keys and values into a paged KV cache.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/common.cuh"

namespace ds::cuda {

struct StoreKvArgs {
  TensorView k;                           // [T, kv_heads, head_dim] F32, strided in T and heads
  TensorView v;                           // likewise; ignored for a latent cache (kv.v == nullptr)
  PagedKv kv;                             // F32, F16, BF16 or FP8 (codes + scales)
  const int32_t* slot_mapping = nullptr;  // [T] device
  int num_tokens = 0;
  DeviceErrors* errors = nullptr;  // a slot outside the cache sets bad_slot; nothing is written
};

void launch_store_kv(const StoreKvArgs& a, cudaStream_t stream);

#ifdef __CUDACC__
// Whether token slot gets stored: not for -1, a padding token (graph buckets), nor for a slot
// outside [0, capacity), which sets bad_slot.
__device__ __forceinline__ bool storable(int64_t slot, int64_t capacity, DeviceErrors* errors) {
  if (slot == -1) return false;
  if (slot < 0 || slot >= capacity) {
    if (threadIdx.x == 0) {
      volatile DeviceErrors* e = errors;
      e->slot = int(slot);
      e->capacity = int(capacity);
      e->bad_slot = 1;
    }
    return false;
  }
  return true;
}
#endif

}  // namespace ds::cuda
