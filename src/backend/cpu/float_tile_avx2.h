// The AVX2 pieces of the float tiles (float_tile.h): 8-lane vectors, F16 / BF16 weights
// widened to F32, a zero-padded tail. Include only from *_avx2.cpp files: everything
// here has internal linkage.
#pragma once

#include "backend/cpu/float_tile.h"
#include "backend/cpu/simd_avx2.h"

namespace ds::cpu::detail {
namespace {

struct TileIsa {
  using V = __m256;
  static constexpr int kW = 8, kMR = 2, kNR = 4;

  static V zero() { return _mm256_setzero_ps(); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256i tail_mask(int64_t n) { return tail_mask8(n); }
  static V load_tail(const float* p, __m256i mask) { return _mm256_maskload_ps(p, mask); }

  template <DType T>
  static V convert(__m128i h) {
    if constexpr (T == DType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }

  template <DType T>
  static V load_w(const uint8_t* w, int64_t k) {
    if constexpr (T == DType::F32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + k);
    } else {
      return convert<T>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k)));
    }
  }

  // The last n < 8 elements from k, zero-padded.
  template <DType T>
  static V load_w_tail(const uint8_t* w, int64_t k, int64_t n, __m256i mask) {
    if constexpr (T == DType::F32) {
      return _mm256_maskload_ps(reinterpret_cast<const float*>(w) + k, mask);
    } else {
      alignas(16) uint16_t tmp[8] = {};
      __builtin_memcpy(tmp, w + 2 * k, size_t(n) * 2);
      return convert<T>(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
    }
  }

  template <int NR>
  static void store_row(const V (&acc)[NR], float* out) {
    store_sums<NR>(acc, out);
  }
};

}  // namespace
}  // namespace ds::cpu::detail
