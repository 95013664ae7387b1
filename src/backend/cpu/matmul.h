// Matrix multiplication with F32 activations and F32 / F16 / BF16 / block-quantized
// weights, dispatched at run time to scalar, AVX2 or AVX-512 VNNI kernels.
//
// Quantized weights: each activation row is first quantized to 8-bit blocks as llama.cpp
// does (Q8_0 values for Q4_0 / Q8_0, plus block sums for Q4_1, Q8_K for the K-quants),
// then multiplied with integer dot products per block and F32 accumulation.
//
// Determinism: an output element's bits depend only on its activation row, its weight
// row and the ISA; never on M, the other rows, the thread count or the tiling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "backend/cpu/cpu_features.h"
#include "core/dtype.h"

namespace ds {
class ThreadPool;
}

namespace ds::cpu {

// out[m, n] = sum_k x[m, k] * W[n, k].
struct MatmulArgs {
  const float* x = nullptr;  // [M, K], row stride ldx floats
  int64_t M = 0, K = 0, ldx = 0;
  const void* w = nullptr;  // [N, K] in wtype, row stride w_row_bytes
  DType wtype = DType::F32;
  int64_t N = 0;
  size_t w_row_bytes = 0;
  float* out = nullptr;  // [M, N], row stride ldo floats
  int64_t ldo = 0;
};

// Runs on `pool` with the kernels of `isa` (which must be supported by this CPU; Amx runs
// the AVX-512 VNNI kernels until AMX tiles are implemented). Throws UnsupportedError for
// weight types matmul_supports() rejects and ds::Error for inconsistent shapes.
void matmul(const MatmulArgs& a, ThreadPool& pool, Isa isa);
bool matmul_supports(DType wtype);

// Dequantizes one row of n elements (a multiple of the block size) to F32.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// Quantizes an F32 row to t: Q8_0, Q8_1, Q8_K, Q4_0, Q4_1, F16, BF16, F32 (llama.cpp's
// reference rounding, so the bytes match gguf-py / ggml).
void quantize_row(DType t, const float* src, void* dst, int64_t n);

}  // namespace ds::cpu
