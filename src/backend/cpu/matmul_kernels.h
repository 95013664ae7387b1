// The interface between matmul.cpp (dispatch, scratch, threading) and the per-ISA kernel
// files. Included by the ISA files: plain types and declarations only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cpu/quants.h"
#include "core/dtype.h"

namespace ds::cpu::detail {

// Byte layout of one activation row quantized for Q4_0 / Q4_1 / Q8_0 weights. Each ISA
// stores the same values (ActBlock's q, d, s) in the order its kernels read fastest.
struct Q8Layout {
  int64_t nb = 0;        // 32-element blocks per row
  size_t c_off = 0;      // byte offset of per-block integer corrections (ISA-specific; or 0)
  size_t d_off = 0;      // byte offset of the per-block scales d (F32)
  size_t s_off = 0;      // byte offset of the per-block s (F32)
  size_t row_bytes = 0;  // stride between rows, a multiple of 64
};

struct Q8Job {
  DType wtype = DType::Q4_0;    // Q4_0, Q4_1 or Q8_0
  const uint8_t* xq = nullptr;  // [M, lay.row_bytes] quantized activations
  Q8Layout lay;
  int64_t M = 0, K = 0;
  const uint8_t* w = nullptr;  // [N, w_row_bytes]
  size_t w_row_bytes = 0;
  float* out = nullptr;  // [M, ldo]
  int64_t ldo = 0;
};

// Float weights (F32, F16, BF16), or block-quantized weights against F32 activations
// (the precise mode).
struct FloatJob {
  DType wtype = DType::F32;
  const float* x = nullptr;  // [M, ldx]
  int64_t ldx = 0;
  int64_t M = 0, K = 0;
  const uint8_t* w = nullptr;
  size_t w_row_bytes = 0;
  float* out = nullptr;
  int64_t ldo = 0;
};

struct KJob {
  DType wtype = DType::Q4_K;      // Q4_K or Q6_K
  const BlockQ8_K* xq = nullptr;  // [M, K / 256]
  int64_t M = 0, K = 0;
  const uint8_t* w = nullptr;
  size_t w_row_bytes = 0;
  float* out = nullptr;
  int64_t ldo = 0;
};

// One ISA's kernels. Every matmul_* call computes out[0..M, n0..n1) and must give each
// output element the same bits whatever M, n0, n1 and the scratch are.
struct Kernels {
  Q8Layout (*q8_layout)(int64_t K);
  // One row, in q8_layout, for weights of type wtype (the layout may hold corrections).
  void (*quantize_q8)(const float* x, int64_t K, DType wtype, uint8_t* row);
  size_t (*scratch_bytes)(int64_t K);  // per-thread scratch matmul_q8 needs
  void (*matmul_q8)(const Q8Job& job, int64_t n0, int64_t n1, uint8_t* scratch);
  void (*matmul_float)(const FloatJob& job, int64_t n0, int64_t n1);
  void (*matmul_k)(const KJob& job, int64_t n0, int64_t n1);
  // Precise mode: block-quantized weights (precise_supports) against F32 activations.
  size_t (*precise_scratch_bytes)(int64_t K);
  void (*matmul_precise)(const FloatJob& job, int64_t n0, int64_t n1, uint8_t* scratch);
};

const Kernels& kernels_avx2();
const Kernels& kernels_avx512();

// Weight types the precise kernels of every ISA take.
bool precise_supports(DType wtype);

// Kernels shared across the tables (defined in the file of their ISA).
void matmul_float_avx2(const FloatJob& job, int64_t n0, int64_t n1);
void matmul_float_avx512(const FloatJob& job, int64_t n0, int64_t n1);
void matmul_k_avx2(const KJob& job, int64_t n0, int64_t n1);
size_t precise_scratch_bytes_avx2(int64_t K);
void matmul_precise_avx2(const FloatJob& job, int64_t n0, int64_t n1, uint8_t* scratch);
size_t precise_scratch_bytes_avx512(int64_t K);
void matmul_precise_avx512(const FloatJob& job, int64_t n0, int64_t n1, uint8_t* scratch);

}  // namespace ds::cpu::detail
