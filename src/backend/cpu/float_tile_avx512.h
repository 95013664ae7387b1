// The AVX-512 pieces of the float tiles (float_tile.h): 16-lane vectors, F16 / BF16
// weights widened to F32, a masked tail. Include only from *_avx512.cpp files:
// everything here has internal linkage.
#pragma once

#include "backend/cpu/float_tile.h"
#include "backend/cpu/simd_avx512.h"

namespace ds::cpu::detail {
namespace {

struct TileIsa {
  using V = __m512;
  static constexpr int kW = 16, kMR = 4, kNR = 4;

  static V zero() { return _mm512_setzero_ps(); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __mmask16 tail_mask(int64_t n) { return tail_mask16(n); }
  static V load_tail(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

  template <DType T>
  static V convert(__m256i h) {
    if constexpr (T == DType::F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }

  template <DType T>
  static V load_w(const uint8_t* w, int64_t k) {
    if constexpr (T == DType::F32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(w) + k);
    } else {
      return convert<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2 * k)));
    }
  }

  template <DType T>
  static V load_w_tail(const uint8_t* w, int64_t k, int64_t /*n*/, __mmask16 mask) {
    if constexpr (T == DType::F32) {
      return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(w) + k);
    } else {
      return convert<T>(_mm256_maskz_loadu_epi16(mask, w + 2 * k));
    }
  }

  template <int NR>
  static void store_row(const V (&acc)[NR], float* out) {
    DS_STORE_SUMS(NR, out, acc);
  }
};

}  // namespace
}  // namespace ds::cpu::detail
