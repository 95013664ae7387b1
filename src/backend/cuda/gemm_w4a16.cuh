// W4A16 GEMMs (backend/w4a16.h layout): out[m, n] = sum_k x[m, k] * w[n, k] with F32
// activations read as they are and 4-bit weights streamed once per pass of up to kTm tokens
// with 16-byte loads, dequantized in registers, F32 FMAs. One fixed-order sum per output
// (batch-invariant: a row's result depends on that row alone); no host sync, no allocation
// (graph-capturable). The same warp core runs the MoE experts (moe_w4a16.cu).
//
// A warp owns kRows weight rows and all of K: lane l takes 16-byte chunks l, l + 32, ... (a
// chunk is 32 codes of one 128-group), sums code * x over the chunk, multiplies by the
// group's scale once, and the warp adds its lanes with an xor butterfly.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attention_port.cuh"
#include "backend/cuda/weight_stream.cuh"
#include "backend/w4a16.h"
#include "core/tensor.h"

namespace ds::cuda {

struct W4a16GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  const float* x = nullptr;  // [m, k] F32, row stride x_row floats
  int64_t x_row = 0;
  const uint8_t* w = nullptr;  // [n, k] W4A16, rows w4a16::row_stride(k) bytes apart
  float* out = nullptr;        // [m, n] F32, row stride out_row floats
  int64_t out_row = 0;
};

// The arguments of Backend::matmul for a W4A16 weight (checks alignment and K).
W4a16GemmArgs w4a16_matmul_args(const TensorView& x, const TensorView& w, const TensorView& out);
void launch_w4a16_gemm(const W4a16GemmArgs& a, cudaStream_t stream);

namespace w4k {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 8;  // weight rows per warp (each loaded activation serves all of them)
constexpr int kTm = 4;    // tokens per pass: kRows * kTm == 32 sums, one per lane to store

// The BF16 scale of chunk c of a row of K elements.
DS_KHD float chunk_scale(const uint8_t* row, int64_t K, int c) {
  const uint8_t* s = row + K / 2 + (c / 4) * 2;
  return w4a16::from_bf16(uint16_t(s[0] | (s[1] << 8)));
}

// Lane `lane`'s share of the dot products of kRows weight rows (K elements, K % 128 == 0)
// with TM activation rows, before the warp sum: v[r * TM + j] = sum over the lane's chunks
// c = lane, lane + 32, ... (ascending) of scale(c) * sum over the chunk's elements (in k
// order) of (code - 8) * xs[j][k]. xs[j] == nullptr: token j absent (its sums stay 0).
// Host-compilable, so the simulation test checks the addressing of the packed rows.
template <int TM>
DS_KDEV void lane_dot(const uint8_t* const (&rows)[kRows], int64_t K, const float* const (&xs)[TM],
                      int lane, float (&v)[kRows * TM]) {
  DS_UNROLL
  for (int i = 0; i < kRows * TM; ++i) v[i] = 0.0f;
  const int chunks = int(K / 32);
  for (int c = lane; c < chunks; c += 32) {
    uint4 w[kRows];
    DS_UNROLL
    for (int r = 0; r < kRows; ++r) w[r] = wstream::load_chunk(rows[r] + int64_t(c) * 16);
    float s[kRows * TM];
    DS_UNROLL
    for (int i = 0; i < kRows * TM; ++i) s[i] = 0.0f;
    DS_UNROLL
    for (int q = 0; q < 4; ++q) {  // word q: elements 8q .. 8q + 7 of the chunk
      float xv[TM][8];
      DS_UNROLL
      for (int j = 0; j < TM; ++j) {
        if (xs[j]) {
          const float* p = xs[j] + int64_t(c) * 32 + 8 * q;
          const float4 a = wstream::load_float4(p), b = wstream::load_float4(p + 4);
          xv[j][0] = a.x, xv[j][1] = a.y, xv[j][2] = a.z, xv[j][3] = a.w;
          xv[j][4] = b.x, xv[j][5] = b.y, xv[j][6] = b.z, xv[j][7] = b.w;
        } else {
          DS_UNROLL
          for (int e = 0; e < 8; ++e) xv[j][e] = 0.0f;
        }
      }
      DS_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const uint32_t word = q == 0 ? w[r].x : q == 1 ? w[r].y : q == 2 ? w[r].z : w[r].w;
        DS_UNROLL
        for (int e = 0; e < 8; ++e) {
          const float f = w4a16::bits_float(0x4b000000u | ((word >> (4 * e)) & 15u)) - 8388616.0f;
          DS_UNROLL
          for (int j = 0; j < TM; ++j) s[r * TM + j] = fmaf(f, xv[j][e], s[r * TM + j]);
        }
      }
    }
    DS_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sc = chunk_scale(rows[r], K, c);
      DS_UNROLL
      for (int j = 0; j < TM; ++j) v[r * TM + j] = fmaf(s[r * TM + j], sc, v[r * TM + j]);
    }
  }
}

#if defined(__CUDACC__)
// The warp's sums: lane_dot, then an xor butterfly, so every lane holds every sum.
template <int TM>
__device__ __forceinline__ void warp_dot(const uint8_t* const (&rows)[kRows], int64_t K,
                                         const float* const (&xs)[TM], int lane,
                                         float (&v)[kRows * TM]) {
  lane_dot<TM>(rows, K, xs, lane, v);
  DS_UNROLL
  for (int i = 0; i < kRows * TM; ++i) {
    DS_UNROLL
    for (int o = 16; o > 0; o /= 2) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
}

// v[i] for a run-time i without indexing the register array.
template <int N>
__device__ __forceinline__ float pick(const float (&v)[N], int i) {
  float r = 0.0f;
  DS_UNROLL
  for (int k = 0; k < N; ++k)
    if (k == i) r = v[k];
  return r;
}
#endif

}  // namespace w4k
}  // namespace ds::cuda
