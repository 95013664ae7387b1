// Small AVX-512 helpers shared by the *_avx512.cpp kernel files (include only from those:
// everything here has internal linkage so no AVX-512 code leaks into other files).
#pragma once

#include "backend/cpu/simd_common.h"

namespace ds::cpu::detail {
namespace {

// Horizontal sums of four vectors, element for element the same addition tree as summing
// one vector alone: lanes l + (l+8), then + (l+4), then + (l+2), then + (l+1). Outputs do
// not depend on which other vectors share the call, so tiles and GEMV agree bit for bit.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 t = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, u));
}

// Sums NR (1..4) accumulators and stores the NR results at out. Takes the vectors by value
// so the callers' accumulator arrays stay in registers.
template <int NR>
inline void store_sums(float* out, __m512 a, __m512 b, __m512 c, __m512 d) {
  const __m128 r = hsum4(a, b, c, d);
  if constexpr (NR == 4) {
    _mm_storeu_ps(out, r);
  } else {
    _mm_mask_storeu_ps(out, __mmask8((1u << NR) - 1), r);
  }
}

// acc[j] for j < NR, else zero: spreads an accumulator row over store_sums' arguments.
template <int NR>
inline __m512 lane_or_zero(const __m512 (&acc)[NR], int j) {
  return j < NR ? acc[j < NR ? j : 0] : _mm512_setzero_ps();
}

#define DS_STORE_SUMS(NR, out, acc)                                       \
  store_sums<NR>(out, lane_or_zero<NR>(acc, 0), lane_or_zero<NR>(acc, 1), \
                 lane_or_zero<NR>(acc, 2), lane_or_zero<NR>(acc, 3))

// Two floats {p[0], p[1]} repeated over 16 lanes: the scales of a block pair.
inline __m512 broadcast_pair(const float* p) {
  double v;
  __builtin_memcpy(&v, p, 8);
  return _mm512_castpd_ps(_mm512_set1_pd(v));
}

inline __mmask16 tail_mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

}  // namespace
}  // namespace ds::cpu::detail
