// AVX2 kernels for Q4_K / Q6_K weights against Q8_K activations (also used by the
// AVX-512 table). One output element at a time: integer sums per 256-element super-block,
// F32 accumulation in k order, so results never depend on M or the thread split.
#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/simd_avx2.h"

namespace ds::cpu::detail {
namespace {

inline float hsum(__m256 v) {
  const __m256 z = _mm256_setzero_ps();
  return _mm_cvtss_f32(hsum4(v, z, z, z));
}

// The eight 6-bit scales (bytes 0..7) and mins (bytes 8..15) of a Q4_K block.
inline void q4k_unpack_scales(const uint8_t* packed, uint8_t* out16) {
  uint32_t u[4];
  __builtin_memcpy(u, packed, 12);
  const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
  u[3] = ((u[2] >> 4) & lo4) | (((u[1] >> 6) & lo2) << 4);  // mins 4..7
  const uint32_t mins_lo = u[1] & lo6;                      // mins 0..3
  u[1] = (u[2] & lo4) | (((u[0] >> 6) & lo2) << 4);         // scales 4..7
  u[2] = mins_lo;
  u[0] &= lo6;  // scales 0..3
  __builtin_memcpy(out16, u, 16);
}

float dot_q4_k(const BlockQ4_K* w, const BlockQ8_K* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.0f;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t sm[16];
    q4k_unpack_scales(w[i].scales, sm);
    int msum = 0;
    for (int j = 0; j < 8; ++j) msum += sm[8 + j] * (x[i].bsums[2 * j] + x[i].bsums[2 * j + 1]);
    __m256i isum = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].qs + 32 * c));
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 64 * c));
      const __m256i x1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 64 * c + 32));
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(q, low4), x0),
                                           _mm256_set1_epi16(sm[2 * c]));
      const __m256i p1 = _mm256_madd_epi16(
          _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4), x1),
          _mm256_set1_epi16(sm[2 * c + 1]));
      isum = _mm256_add_epi32(isum, _mm256_add_epi32(p0, p1));
    }
    const float d = _cvtsh_ss(w[i].d) * x[i].d;
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc);
    mins += _cvtsh_ss(w[i].dmin) * x[i].d * float(msum);
  }
  return hsum(acc) - mins;
}

float dot_q6_k(const BlockQ6_K* w, const BlockQ8_K* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  float offs = 0.0f;
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  for (int64_t i = 0; i < nb; ++i) {
    const int8_t* sc = w[i].scales;
    int corr = 0;  // the -32 offset of every value, through the group sums of x
    for (int g = 0; g < 16; ++g) corr += sc[g] * x[i].bsums[g];
    __m256i isum = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].ql + 64 * n));
      const __m256i qb =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].ql + 64 * n + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].qh + 32 * n));
      const __m256i v[4] = {
          _mm256_or_si256(_mm256_and_si256(qa, low4),
                          _mm256_slli_epi16(_mm256_and_si256(h, low2), 4)),
          _mm256_or_si256(_mm256_and_si256(qb, low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), low2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), low2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), low2), 4)),
      };
      for (int k = 0; k < 4; ++k) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 128 * n + 32 * k));
        const int g = 8 * n + 2 * k;  // 16-element groups g and g + 1
        const __m256i s = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(sc[g])),
                                                  _mm_set1_epi16(sc[g + 1]), 1);
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(v[k], xv), s));
      }
    }
    const float d = _cvtsh_ss(w[i].d) * x[i].d;
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc);
    offs += d * float(32 * corr);
  }
  return hsum(acc) - offs;
}

}  // namespace

void matmul_k_avx2(const KJob& j, int64_t n0, int64_t n1) {
  const int64_t nb = j.K / kQkK;
  for (int64_t m = 0; m < j.M; ++m) {
    const BlockQ8_K* x = j.xq + m * nb;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = j.w + n * j.w_row_bytes;
      j.out[m * j.ldo + n] = j.wtype == DType::Q4_K
                                 ? dot_q4_k(reinterpret_cast<const BlockQ4_K*>(w), x, nb)
                                 : dot_q6_k(reinterpret_cast<const BlockQ6_K*>(w), x, nb);
    }
  }
}

}  // namespace ds::cpu::detail
