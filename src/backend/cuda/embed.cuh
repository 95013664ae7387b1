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

#ifdef __CUDACC__
// The token loop of the embed kernels (embed.cu, gemm_gguf.cu): one CTA per token, grid-stride.
// An id outside [0, vocab) sets bad_token and zeroes its row; a good one is written by
// fill(o, id), the block's threads filling the dim floats at o.
template <typename Fill>
__device__ __forceinline__ void embed_rows(const int32_t* __restrict__ ids, int n, int64_t vocab,
                                           void* out, RowIndex orow, int64_t dim,
                                           DeviceErrors* errors, Fill&& fill) {
  for (int t = int(blockIdx.x); t < n; t += int(gridDim.x)) {
    const int32_t id = ids[t];
    float* o = at_bytes<float>(out, orow.offset(t));
    if (id < 0 || id >= vocab) {
      if (threadIdx.x == 0) {
        volatile DeviceErrors* e = errors;
        e->token = id;
        e->vocab = int(vocab);
        e->bad_token = 1;
      }
      for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = 0.0f;
      continue;
    }
    fill(o, id);
  }
}
#endif

}  // namespace ds::cuda
