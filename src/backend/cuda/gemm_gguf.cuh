// GGUF block-quantized weights on CUDA (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), the
// blocks in device memory exactly as in the file: matmul (F32 activations, weights dequantized
// in registers, each weight row streamed once per pass of up to 8 tokens; one fixed-order sum
// per output, no host sync, graph-capturable) and the embedding lookup of a quantized table.
// The MoE experts run the same warp core (moe_gguf.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/common.cuh"
#include "core/tensor.h"

namespace ds::cuda {

// Whether the CUDA GGUF kernels read blocks of type t.
bool is_gguf_block_type(DType t);

struct GgufGemmArgs {
  DType dtype = DType::Q8_0;
  int64_t m = 0, n = 0, k = 0;
  const float* x = nullptr;  // [m, k] F32, row stride x_row floats
  int64_t x_row = 0;
  const uint8_t* w = nullptr;  // [n, k] blocks, rows w_row bytes apart (2-byte aligned)
  int64_t w_row = 0;
  float* out = nullptr;  // [m, n] F32, row stride out_row floats
  int64_t out_row = 0;
};

// The arguments of Backend::matmul for a GGUF weight (checks shapes and alignment).
GgufGemmArgs gguf_matmul_args(const TensorView& x, const TensorView& w, const TensorView& out);
void launch_gguf_gemm(const GgufGemmArgs& a, cudaStream_t stream);

// out[t, :] = dequantized table row ids[t] (an id outside the table sets bad_token, row zeroed).
void launch_gguf_embed(const TensorView& table, const int32_t* ids, int n, TensorView out,
                       DeviceErrors* errors, cudaStream_t stream);

}  // namespace ds::cuda
