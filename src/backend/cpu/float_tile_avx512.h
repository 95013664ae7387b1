// F32 FMA register tiles over F32 / F16 / BF16 weight rows, shared by the float-weight
// kernels and the precise quantized kernels (which run them on dequantized panels).
// Include only from *_avx512.cpp files: everything here has internal linkage.
//
// Each output element accumulates 16-lane chunks of k in order (a masked chunk for
// the tail), then hsum4: the same sequence in every tile shape, so results do not depend
// on M.
#pragma once

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/simd_avx512.h"

namespace ds::cpu::detail {
namespace {

namespace ftiles {
constexpr int kMR = 4, kNR = 4;
}  // namespace ftiles

template <DType T>
inline __m512 load_w(const uint8_t* w, int64_t k) {
  if constexpr (T == DType::F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(w) + k);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2 * k));
    if constexpr (T == DType::F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <DType T>
inline __m512 load_w_tail(const uint8_t* w, int64_t k, __mmask16 mask) {
  if constexpr (T == DType::F32) {
    return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(w) + k);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, w + 2 * k);
    if constexpr (T == DType::F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <DType T, int MR, int NR>
void ftile(const float* x, int64_t ldx, const uint8_t* w, size_t wrb, int64_t K, float* out,
           int64_t ldo) {
  __m512 acc[MR][NR];
  DS_UNROLL
  for (int i = 0; i < MR; ++i) DS_UNROLL
  for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(x + i * ldx + k);
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = load_w<T>(w + j * wrb, k);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = tail_mask16(K - k);
    __m512 xv[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * ldx + k);
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = load_w_tail<T>(w + j * wrb, k, mask);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  DS_UNROLL
  for (int i = 0; i < MR; ++i) DS_STORE_SUMS(NR, out + i * ldo, acc[i]);
}

using FTileFn = void (*)(const float*, int64_t, const uint8_t*, size_t, int64_t, float*, int64_t);

template <DType T, int MR>
constexpr FTileFn ftile_for(int nr) {
  return nr == 4   ? ftile<T, MR, 4>
         : nr == 3 ? ftile<T, MR, 3>
         : nr == 2 ? ftile<T, MR, 2>
                   : ftile<T, MR, 1>;
}

template <DType T>
FTileFn ftile_for(int mr, int nr) {
  switch (mr) {
    case 4:
      return ftile_for<T, 4>(nr);
    case 3:
      return ftile_for<T, 3>(nr);
    case 2:
      return ftile_for<T, 2>(nr);
    default:
      return ftile_for<T, 1>(nr);
  }
}

}  // namespace
}  // namespace ds::cpu::detail
