// AVX2 kernels for F32 / F16 / BF16 weights: F32 FMA register tiles.
//
// Each output element accumulates 8-lane chunks of k in order (a zero-padded chunk for
// the tail), then hsum4: the same sequence in every tile shape.
#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/simd_avx2.h"

namespace ds::cpu::detail {
namespace {

constexpr int kMR = 2, kNR = 4;
constexpr int64_t kMBlock = 64;

constexpr int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}

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

template <DType T>
void run(const FloatJob& j, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < j.M; m0 += kMBlock) {
    const int64_t m1 = imin(j.M, m0 + kMBlock);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int nr = int(imin(kNR, n1 - n));
      const uint8_t* w = j.w + n * j.w_row_bytes;
      for (int64_t m = m0; m < m1; m += kMR) {
        const FTileFn fn = m + 1 < m1 ? ftile_for<T, 2>(nr) : ftile_for<T, 1>(nr);
        fn(j.x + m * j.ldx, j.ldx, w, j.w_row_bytes, j.K, j.out + m * j.ldo + n, j.ldo);
      }
    }
  }
}

}  // namespace

void matmul_float_avx2(const FloatJob& j, int64_t n0, int64_t n1) {
  switch (j.wtype) {
    case DType::F32:
      return run<DType::F32>(j, n0, n1);
    case DType::F16:
      return run<DType::F16>(j, n0, n1);
    default:
      return run<DType::BF16>(j, n0, n1);
  }
}

}  // namespace ds::cpu::detail
