// AVX2 precise kernels: block-quantized weights against F32 activations. The loops are
// matmul_precise.h's; this file decodes blocks into 8-lane chunks, each weight to the F32
// value listed there.
#include "backend/cpu/float_tile_avx2.h"
#include "backend/cpu/matmul_precise.h"

namespace ds::cpu::detail {
namespace {

inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}

// ---- the dequantization every path shares ----

// Eight Q4 values q (0..15) with scale d and min m.
template <DType T>
inline __m256 q4_chunk(__m256i q, __m256 d, __m256 m) {
  const __m256 f = _mm256_cvtepi32_ps(q);
  if constexpr (T == DType::Q4_0) return _mm256_mul_ps(d, _mm256_sub_ps(f, _mm256_set1_ps(8.0f)));
  return _mm256_fmadd_ps(d, f, m);
}

// The four 8-element chunks of a Q4 block in element order.
template <DType T>
inline void q4_values(const uint8_t* qs, float d, float m, __m256* out) {
  const __m256i v0 = bytes8(qs), v1 = bytes8(qs + 8), low4 = _mm256_set1_epi32(0x0f);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  out[0] = q4_chunk<T>(_mm256_and_si256(v0, low4), dv, mv);
  out[1] = q4_chunk<T>(_mm256_and_si256(v1, low4), dv, mv);
  out[2] = q4_chunk<T>(_mm256_srli_epi32(v0, 4), dv, mv);
  out[3] = q4_chunk<T>(_mm256_srli_epi32(v1, 4), dv, mv);
}

inline __m256 q8_chunk(const int8_t* qs, float d) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)qs));
  return _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(v));
}

// A Q5_0 / Q5_1 block: element j is nibble j of qs (low nibbles first) plus bit j of qh.
template <DType T>
void dequant_q5(const uint8_t* blk, float* out) {
  constexpr int kQh = T == DType::Q5_1 ? 4 : 2;
  uint32_t qh;
  __builtin_memcpy(&qh, blk + kQh, 4);
  const __m256 d = _mm256_set1_ps(h2f(blk)),
               m = _mm256_set1_ps(T == DType::Q5_1 ? h2f(blk + 2) : 0.f);
  const __m256i h = _mm256_set1_epi32(int(qh)), one = _mm256_set1_epi32(1);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), low4 = _mm256_set1_epi32(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = bytes8(blk + kQh + 4 + 8 * (c & 1));
    const __m256i nib = c < 2 ? _mm256_and_si256(v, low4) : _mm256_srli_epi32(v, 4);
    const __m256i bit = _mm256_and_si256(
        _mm256_srlv_epi32(h, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * c))), one);
    const __m256i q = _mm256_or_si256(nib, _mm256_slli_epi32(bit, 4));
    __m256 w;
    if constexpr (T == DType::Q5_0)
      w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))));
    else
      w = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
    _mm256_storeu_ps(out + 8 * c, w);
  }
}

void dequant_q5_k(const BlockQ5_K& b, float* out) {
  const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
  const __m256i low4 = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
  for (int j = 0; j < 4; ++j) {
    uint8_t sc[2], mn[2];
    q4k_scale_min(b.scales, 2 * j, &sc[0], &mn[0]);
    q4k_scale_min(b.scales, 2 * j + 1, &sc[1], &mn[1]);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = bytes8(b.qs + 32 * j + 8 * c), hq = bytes8(b.qh + 8 * c);
      for (int s = 0; s < 2; ++s) {
        const __m256i nib = s == 0 ? _mm256_and_si256(v, low4) : _mm256_srli_epi32(v, 4);
        const __m256i bit =
            _mm256_and_si256(_mm256_srl_epi32(hq, _mm_cvtsi32_si128(2 * j + s)), one);
        const __m256i q = _mm256_or_si256(nib, _mm256_slli_epi32(bit, 4));
        _mm256_storeu_ps(out + 64 * j + 32 * s + 8 * c,
                         _mm256_fmadd_ps(_mm256_set1_ps(d * float(sc[s])), _mm256_cvtepi32_ps(q),
                                         _mm256_set1_ps(-(dmin * float(mn[s])))));
      }
    }
  }
}

void dequant_q4_k(const BlockQ4_K& b, float* out) {
  const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
  const __m256i low4 = _mm256_set1_epi32(0x0f);
  for (int j = 0; j < 4; ++j) {
    uint8_t sc[2], mn[2];
    q4k_scale_min(b.scales, 2 * j, &sc[0], &mn[0]);
    q4k_scale_min(b.scales, 2 * j + 1, &sc[1], &mn[1]);
    __m256 ds[2], ms[2];
    for (int h = 0; h < 2; ++h) {
      ds[h] = _mm256_set1_ps(d * float(sc[h]));
      ms[h] = _mm256_set1_ps(-(dmin * float(mn[h])));
    }
    for (int c = 0; c < 4; ++c) {
      const __m256i v = bytes8(b.qs + 32 * j + 8 * c);
      _mm256_storeu_ps(
          out + 64 * j + 8 * c,
          _mm256_fmadd_ps(ds[0], _mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), ms[0]));
      _mm256_storeu_ps(out + 64 * j + 32 + 8 * c,
                       _mm256_fmadd_ps(ds[1], _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), ms[1]));
    }
  }
}

void dequant_q6_k(const BlockQ6_K& b, float* out) {
  const float d = _cvtsh_ss(b.d);
  const __m256i low4 = _mm256_set1_epi32(0x0f), two = _mm256_set1_epi32(0x30);
  for (int n = 0; n < 2; ++n)
    for (int l0 = 0; l0 < 32; l0 += 8) {
      const uint8_t* ql = b.ql + 64 * n + l0;
      const __m256i la = bytes8(ql), lb = bytes8(ql + 32), h = bytes8(b.qh + 32 * n + l0);
      // Elements 128n + l, + 32, + 64, + 96 (see the AVX-512 file).
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(la, low4),
                          _mm256_and_si256(_mm256_slli_epi32(h, 4), two)),
          _mm256_or_si256(_mm256_and_si256(lb, low4),
                          _mm256_and_si256(_mm256_slli_epi32(h, 2), two)),
          _mm256_or_si256(_mm256_srli_epi32(la, 4), _mm256_and_si256(h, two)),
          _mm256_or_si256(_mm256_srli_epi32(lb, 4), _mm256_and_si256(_mm256_srli_epi32(h, 2), two)),
      };
      for (int k = 0; k < 4; ++k) {
        const int e = 128 * n + 32 * k + l0;
        const float dg = d * float(b.scales[e / 16]);
        const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[k], _mm256_set1_epi32(32)));
        _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_set1_ps(dg), v));
      }
    }
}

// The AVX2 pieces of the precise loops (matmul_precise.h).
struct PreciseIsa {
  using V = __m256;
  using Tile = TileIsa;
  static constexpr int kW = 8, kRows = 4;

  static V zero() { return _mm256_setzero_ps(); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

  // dm[0..n) = the n halves at half, converted (n a multiple of 8; both 32-byte aligned).
  static void halves_to_floats(const uint32_t* half, int n, float* dm) {
    for (int i = 0; i < n; i += 8)
      _mm256_store_ps(dm + i, _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(half + i / 2))));
  }

  // The four chunks of a Q4_0 / Q4_1 / Q8_0 block with scale d and min m.
  template <DType T>
  static void decode(const uint8_t* blk, float d, float m, V* w) {
    if constexpr (T == DType::Q8_0) {
      for (int k = 0; k < 4; ++k)
        w[k] = q8_chunk(reinterpret_cast<const int8_t*>(blk + 2 + 8 * k), d);
    } else {
      q4_values<T>(blk + (T == DType::Q4_1 ? 4 : 2), d, m, w);
    }
  }

  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }

  // The block types decoded through an L1 buffer (dequant_block, matmul_precise.h).
  template <DType T>
  static void dequant_q5(const uint8_t* blk, float* out) {
    detail::dequant_q5<T>(blk, out);
  }
  static void dequant_q4_k(const BlockQ4_K& b, float* out) { detail::dequant_q4_k(b, out); }
  static void dequant_q5_k(const BlockQ5_K& b, float* out) { detail::dequant_q5_k(b, out); }
  static void dequant_q6_k(const BlockQ6_K& b, float* out) { detail::dequant_q6_k(b, out); }

  // The sums of the first nr of kRows accumulators.
  static void store_rows(const V* acc, int nr, float* out) {
    alignas(16) float s[4];
    _mm_store_ps(s, hsum4(acc[0], acc[1], acc[2], acc[3]));
    for (int r = 0; r < nr; ++r) out[r] = s[r];
  }
};

}  // namespace

size_t precise_scratch_bytes_avx2(int64_t K) {
  return precise::scratch_bytes<PreciseIsa>(K);
}

void matmul_precise_avx2(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  precise::matmul<PreciseIsa>(j, n0, n1, scratch);
}

}  // namespace ds::cpu::detail
