// Small AVX2 helpers shared by the *_avx2.cpp kernel files (include only from those:
// everything here has internal linkage so no AVX2 code leaks into other files).
#pragma once

#include "backend/cpu/simd_common.h"

namespace ds::cpu::detail {
namespace {

// Horizontal sums of four vectors with, element for element, the same addition tree as
// one vector alone (l + (l+4), then + (l+2), then + (l+1)): batching never changes bits.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab =
      _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd =
      _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

template <int NR>
inline void store_sums(const __m256* acc, float* out) {
  const __m256 z = _mm256_setzero_ps();
  const __m128 r = hsum4(acc[0], NR > 1 ? acc[1] : z, NR > 2 ? acc[2] : z, NR > 3 ? acc[3] : z);
  if constexpr (NR == 4) {
    _mm_storeu_ps(out, r);
  } else {
    alignas(16) float tmp[4];
    _mm_store_ps(tmp, r);
    for (int j = 0; j < NR; ++j) out[j] = tmp[j];
  }
}

// Lanes [0, n) set (n < 8) for masked loads of a tail.
inline __m256i tail_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

}  // namespace
}  // namespace ds::cpu::detail
