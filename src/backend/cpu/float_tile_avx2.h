// F32 FMA register tiles over F32 / F16 / BF16 weight rows, shared by the float-weight
// kernels and the precise quantized kernels (which run them on dequantized panels).
// Include only from *_avx2.cpp files: everything here has internal linkage.
//
// Each output element accumulates 8-lane chunks of k in order (a zero-padded chunk for
// the tail), then hsum4: the same sequence in every tile shape, so results do not depend
// on M.
#pragma once

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/simd_avx2.h"

namespace ds::cpu::detail {
namespace {

namespace ftiles {
constexpr int kMR = 2, kNR = 4;
}  // namespace ftiles

template <DType T>
inline __m256 convert(__m128i h) {
  if constexpr (T == DType::F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <DType T>
inline __m256 load_w(const uint8_t* w, int64_t k) {
  if constexpr (T == DType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + k);
  } else {
    return convert<T>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k)));
  }
}

// The last n < 8 elements from k, zero-padded.
template <DType T>
inline __m256 load_w_tail(const uint8_t* w, int64_t k, int64_t n) {
  if constexpr (T == DType::F32) {
    return _mm256_maskload_ps(reinterpret_cast<const float*>(w) + k, tail_mask8(n));
  } else {
    alignas(16) uint16_t tmp[8] = {};
    __builtin_memcpy(tmp, w + 2 * k, size_t(n) * 2);
    return convert<T>(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  }
}

template <DType T, int MR, int NR>
void ftile(const float* x, int64_t ldx, const uint8_t* w, size_t wrb, int64_t K, float* out,
           int64_t ldo) {
  __m256 acc[MR][NR];
  DS_UNROLL
  for (int i = 0; i < MR; ++i) DS_UNROLL
  for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = load_w<T>(w + j * wrb, k);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  if (k < K) {
    const __m256i mask = tail_mask8(K - k);
    __m256 xv[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_maskload_ps(x + i * ldx + k, mask);
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = load_w_tail<T>(w + j * wrb, k, K - k);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  DS_UNROLL
  for (int i = 0; i < MR; ++i) store_sums<NR>(acc[i], out + i * ldo);
}

using FTileFn = void (*)(const float*, int64_t, const uint8_t*, size_t, int64_t, float*, int64_t);

template <DType T, int MR>
constexpr FTileFn ftile_for(int nr) {
  return nr == 4   ? ftile<T, MR, 4>
         : nr == 3 ? ftile<T, MR, 3>
         : nr == 2 ? ftile<T, MR, 2>
                   : ftile<T, MR, 1>;
}

}  // namespace
}  // namespace ds::cpu::detail
