// Token embedding lookup.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/common.cuh"
#include "core/tensor.h"

namespace ds::cuda {

struct EmbedArgs {
  TensorView table;              // [vocab, hidden] F32, F16 or BF16
  const int32_t* ids = nullptr;  // [n] device
  int n = 0;
  TensorView out;                  // [n, hidden] F32
  DeviceErrors* errors = nullptr;  // an id outside the table sets bad_token; its row is zeroed
};

void launch_embed(const EmbedArgs& a, cudaStream_t stream);

}  // namespace ds::cuda
