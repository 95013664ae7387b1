// GGML block-quantized layouts, scalar reference (de)quantization and dot products.
//
// The scalar code here is the ground truth the SIMD kernels are tested against. This
// header is included by the ISA-specific files, so it holds only types and declarations
// (no inline functions that could be emitted with ISA flags and merged by the linker).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace ds::cpu {

inline constexpr int kQk = 32;    // elements per block of the 32-element formats
inline constexpr int kQkK = 256;  // elements per super-block of the K-quants

// Layouts follow ggml-common.h; fp16 fields are raw IEEE half bits.
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQk / 2];  // element j in the low nibble of qs[j], element j+16 in the high
};
struct BlockQ4_1 {
  uint16_t d, m;  // x = d * q + m
  uint8_t qs[kQk / 2];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];  // bit j = fifth bit of element j
  uint8_t qs[kQk / 2];
};
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[kQk / 2];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQk];
};
struct BlockQ8_1 {
  uint16_t d, s;  // s = d * sum(qs)
  int8_t qs[kQk];
};
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];  // 8 six-bit scales and 8 six-bit mins, packed
  uint8_t qs[kQkK / 2];
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[kQkK / 8];
  uint8_t qs[kQkK / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQkK / 2];
  uint8_t qh[kQkK / 4];
  int8_t scales[kQkK / 16];
  uint16_t d;
};
struct BlockQ8_K {
  float d;
  int8_t qs[kQkK];
  int16_t bsums[kQkK / 16];  // sums of each group of 16 qs
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292);

// One activation block as the scalar kernels read it, bit for bit what llama.cpp's x86
// quantize_row_q8_0 / quantize_row_q8_1 (AVX2 / AVX-512 builds) store: q = x * (127 / amax)
// rounded half to even, d = fp16(amax / 127), s = fp16(d * sum(q)) with the unrounded d.
// d and s are kept as the F32 values of those fp16 numbers.
struct ActBlock {
  float d;
  float s;
  int8_t qs[kQk];
};

// Quantizes one block of 32 floats the way ggml's quantize_row_q8_1_ref does (the bytes
// gguf-py writes): d = amax / 127, q = roundf(x / d). Returns sum(q); *d_out is d unrounded.
int quantize_block_q8(const float* x, int8_t* q, float* d_out);
// Quantizes one activation block the way llama.cpp's SIMD quantizers do (see ActBlock).
void quantize_block_act(const float* x, ActBlock* out);

// Scalar reference conversions (n a multiple of the block size).
void dequantize_row_ref(DType t, const void* src, float* dst, int64_t n);
void quantize_row_ref(DType t, const float* src, void* dst, int64_t n);
void quantize_row_act(const float* x, ActBlock* dst, int64_t n);

// Scalar reference dot products of one weight row with one activation row, summed the
// way llama.cpp's AVX2 vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 do: eight F32 lanes, lane u
// taking the exact integer sum over elements 4u..4u+3 of each block in k order,
//   acc[u] = fma(d_w * d_x, float(isum_u), acc[u]),
// then ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)); Q4_1 adds summs = fma(m_w, s_x, summs) last.
// nb = number of weight blocks.
float vec_dot_q4_0(const BlockQ4_0* w, const ActBlock* x, int64_t nb);
float vec_dot_q4_1(const BlockQ4_1* w, const ActBlock* x, int64_t nb);
float vec_dot_q8_0(const BlockQ8_0* w, const ActBlock* x, int64_t nb);
// K-quants against Q8_K: integer sums per super-block, one F32 accumulator in k order.
float vec_dot_q4_k(const BlockQ4_K* w, const BlockQ8_K* x, int64_t nb);
float vec_dot_q6_k(const BlockQ6_K* w, const BlockQ8_K* x, int64_t nb);
// Weights F32 / F16 / BF16 against F32 activations, k in order.
float vec_dot_f32(const float* w, const float* x, int64_t n);
float vec_dot_f16(const uint16_t* w, const float* x, int64_t n);
float vec_dot_bf16(const uint16_t* w, const float* x, int64_t n);

// Unpacks the 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block.
void q4k_scale_min(const uint8_t* scales, int j, uint8_t* sc, uint8_t* m);

}  // namespace ds::cpu
