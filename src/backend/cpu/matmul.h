// Matrix multiplication with F32 activations and F32 / F16 / BF16 / block-quantized
// weights, dispatched at run time to scalar, AVX2 or AVX-512 kernels.
//
// Block-quantized weights run in one of two activation precisions (MatmulArgs::act):
//  - F32 (precise, the default): the activations stay F32; each weight block is
//    dequantized inside the kernel (w = d * q + m as one fma) and multiplied with F32 FMAs.
//    Decode streams the weights through registers; prefill dequantizes a panel of weight
//    rows once into an L1-resident buffer and reuses it for many activation rows.
//  - Q8 (llama.cpp-compatible): each activation row is quantized to 8-bit blocks exactly
//    as llama.cpp's x86 SIMD code does (Q8_0 / Q8_1 for Q4_0 / Q4_1 / Q8_0 weights, Q8_K
//    for the K-quants), then multiplied with integer dot products per block, with the
//    F32 combination of llama.cpp's AVX2 vec_dot kernels.
//
// Determinism: an output element's bits depend only on its activation row, its weight
// row, the precision and the ISA; never on M, the other rows, the thread count or the
// tiling.
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

// How activations meet block-quantized weights (float weights ignore it).
enum class ActPrecision : uint8_t {
  F32,  // no activation quantization: dequantized weights times F32 activations
  Q8,   // 8-bit activation blocks, bit-compatible with llama.cpp on x86
};

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
  ActPrecision act = ActPrecision::F32;
};

// Runs on `pool` with the kernels of `isa` (which must be supported by this CPU; Amx runs
// the AVX-512 kernels until AMX tiles are implemented). Throws UnsupportedError for
// weight types matmul_supports() rejects and ds::Error for inconsistent shapes.
void matmul(const MatmulArgs& a, ThreadPool& pool, Isa isa);
// Weight types matmul runs in the given activation precision.
bool matmul_supports(DType wtype, ActPrecision act = ActPrecision::F32);

// Dequantizes one row of n elements (a multiple of the block size) to F32.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// Quantizes an F32 row to t: Q8_0, Q8_1, Q8_K, Q4_0, Q4_1, F16, BF16, F32 (llama.cpp's
// reference rounding, so the bytes match gguf-py / ggml).
void quantize_row(DType t, const float* src, void* dst, int64_t n);

}  // namespace ds::cpu
