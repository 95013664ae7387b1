// AVX-512 precise kernels: block-quantized weights against F32 activations. The loops are
// matmul_precise.h's; this file decodes blocks into 16-lane chunks (nibble codes looked up
// in per-block tables of values), each weight to the F32 value listed there.
#include "backend/cpu/float_tile_avx512.h"
#include "backend/cpu/matmul_precise.h"

namespace ds::cpu::detail {
namespace {

inline __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// ---- the dequantization every path shares ----

// The values of nibbles 0..15 in a block with scale d (and min m, Q4_1).
template <DType T>
inline __m512 q4_table(float d, float m) {
  if constexpr (T == DType::Q4_0)
    return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)));
  return _mm512_fmadd_ps(_mm512_set1_ps(d), iota16(), _mm512_set1_ps(m));
}

// Elements 0..15 (low nibbles of qs[0..15]) and 16..31 (high nibbles) through the table.
inline void q4_values(const uint8_t* qs, __m512 table, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
  lo = _mm512_permutexvar_ps(v, table);  // vpermps reads the low four index bits
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

// The values of 5-bit codes 0..15 (t0) and 16..31 (t1): Q5_0 d * (q - 16), else fma(d, q, m).
template <DType T>
inline void q5_tables(float d, float m, __m512& t0, __m512& t1) {
  const __m512 dv = _mm512_set1_ps(d), sixteen = _mm512_set1_ps(16.0f);
  if constexpr (T == DType::Q5_0) {
    t0 = _mm512_mul_ps(dv, _mm512_sub_ps(iota16(), sixteen));
    t1 = _mm512_mul_ps(dv, iota16());
  } else {
    t0 = _mm512_fmadd_ps(dv, iota16(), _mm512_set1_ps(m));
    t1 = _mm512_fmadd_ps(dv, _mm512_add_ps(iota16(), sixteen), _mm512_set1_ps(m));
  }
}

// Sixteen 5-bit values: code = nibble | bit << 4, looked up in the two tables.
inline __m512 q5_lookup(__m512i nibble, __m512i bit, __m512 t0, __m512 t1) {
  const __m512i code = _mm512_or_si512(nibble, _mm512_slli_epi32(bit, 4));
  return _mm512_permutex2var_ps(t0, code, t1);  // index bit 4 picks t1
}

// A Q5_0 / Q5_1 block: element j is nibble j of qs (low nibbles first) plus bit j of qh.
template <DType T>
void dequant_q5(const uint8_t* blk, float* out) {
  constexpr int kQh = T == DType::Q5_1 ? 4 : 2;
  uint32_t qh;
  __builtin_memcpy(&qh, blk + kQh, 4);
  __m512 t0, t1;
  q5_tables<T>(h2f(blk), T == DType::Q5_1 ? h2f(blk + 2) : 0.0f, t0, t1);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + kQh + 4)));
  const __m512i h = _mm512_set1_epi32(int(qh)), one = _mm512_set1_epi32(1);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i b0 = _mm512_and_si512(_mm512_srlv_epi32(h, lanes), one);
  const __m512i b1 =
      _mm512_and_si512(_mm512_srlv_epi32(h, _mm512_add_epi32(lanes, _mm512_set1_epi32(16))), one);
  _mm512_storeu_ps(out, q5_lookup(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)), b0, t0, t1));
  _mm512_storeu_ps(out + 16, q5_lookup(_mm512_srli_epi32(v, 4), b1, t0, t1));
}

void dequant_q5_k(const BlockQ5_K& b, float* out) {
  const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
  const __m512i one = _mm512_set1_epi32(1);
  for (int j = 0; j < 4; ++j) {
    uint8_t sc[2], mn[2];
    q4k_scale_min(b.scales, 2 * j, &sc[0], &mn[0]);
    q4k_scale_min(b.scales, 2 * j + 1, &sc[1], &mn[1]);
    __m512 t[2][2];  // [sub-block][codes 0..15, 16..31]
    for (int s = 0; s < 2; ++s) {
      const __m512 ds = _mm512_set1_ps(d * float(sc[s])),
                   ms = _mm512_set1_ps(-(dmin * float(mn[s])));
      t[s][0] = _mm512_fmadd_ps(ds, iota16(), ms);
      t[s][1] = _mm512_fmadd_ps(ds, _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f)), ms);
    }
    for (int h = 0; h < 2; ++h) {
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b.qs + 32 * j + 16 * h)));
      const __m512i hq = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b.qh + 16 * h)));
      const __m512i b0 = _mm512_and_si512(_mm512_srli_epi32(hq, unsigned(2 * j)), one);
      const __m512i b1 = _mm512_and_si512(_mm512_srli_epi32(hq, unsigned(2 * j + 1)), one);
      _mm512_storeu_ps(
          out + 64 * j + 16 * h,
          q5_lookup(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)), b0, t[0][0], t[0][1]));
      _mm512_storeu_ps(out + 64 * j + 32 + 16 * h,
                       q5_lookup(_mm512_srli_epi32(v, 4), b1, t[1][0], t[1][1]));
    }
  }
}

// Sixteen Q8_0 elements from qs.
inline __m512 q8_values(const int8_t* qs, float d) {
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qs));
  return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(v));
}

void dequant_q4_k(const BlockQ4_K& b, float* out) {
  const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
  for (int j = 0; j < 4; ++j) {
    uint8_t sc[2], mn[2];
    q4k_scale_min(b.scales, 2 * j, &sc[0], &mn[0]);
    q4k_scale_min(b.scales, 2 * j + 1, &sc[1], &mn[1]);
    __m512 t[2];
    for (int h = 0; h < 2; ++h)
      t[h] = _mm512_fmadd_ps(_mm512_set1_ps(d * float(sc[h])), iota16(),
                             _mm512_set1_ps(-(dmin * float(mn[h]))));
    for (int h = 0; h < 2; ++h) {
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b.qs + 32 * j + 16 * h)));
      _mm512_storeu_ps(out + 64 * j + 16 * h, _mm512_permutexvar_ps(v, t[0]));
      _mm512_storeu_ps(out + 64 * j + 32 + 16 * h,
                       _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t[1]));
    }
  }
}

void dequant_q6_k(const BlockQ6_K& b, float* out) {
  const float d = _cvtsh_ss(b.d);
  const __m512i low4 = _mm512_set1_epi32(0x0f), two = _mm512_set1_epi32(0x30);
  for (int n = 0; n < 2; ++n)
    for (int l0 = 0; l0 < 32; l0 += 16) {
      const uint8_t* ql = b.ql + 64 * n + l0;
      const __m512i la = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)ql));
      const __m512i lb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(ql + 32)));
      const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b.qh + 32 * n + l0)));
      // Elements 128n + l, + 32, + 64, + 96: low / high nibbles of ql[l] and ql[l + 32]
      // with bit pairs 0, 1, 2, 3 of qh[l] on top.
      const __m512i q[4] = {
          _mm512_or_si512(_mm512_and_si512(la, low4),
                          _mm512_and_si512(_mm512_slli_epi32(h, 4), two)),
          _mm512_or_si512(_mm512_and_si512(lb, low4),
                          _mm512_and_si512(_mm512_slli_epi32(h, 2), two)),
          _mm512_or_si512(_mm512_srli_epi32(la, 4), _mm512_and_si512(h, two)),
          _mm512_or_si512(_mm512_srli_epi32(lb, 4), _mm512_and_si512(_mm512_srli_epi32(h, 2), two)),
      };
      for (int k = 0; k < 4; ++k) {
        const int e = 128 * n + 32 * k + l0;
        const float dg = d * float(b.scales[e / 16]);
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(q[k], _mm512_set1_epi32(32)));
        _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_set1_ps(dg), v));
      }
    }
}

// The AVX-512 pieces of the precise loops (matmul_precise.h).
struct PreciseIsa {
  using V = __m512;
  using Tile = TileIsa;
  static constexpr int kW = 16, kRows = 8;  // kRows: GEMV rows per pass (hides FMA latency)

  static V zero() { return _mm512_setzero_ps(); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p) { return _mm512_load_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }

  // dm[0..n) = the n halves at half, converted (n a multiple of 16; both 64-byte aligned).
  static void halves_to_floats(const uint32_t* half, int n, float* dm) {
    for (int i = 0; i < n; i += 16)
      _mm512_store_ps(dm + i, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(half + i / 2))));
  }

  // The two halves of a Q4_0 / Q4_1 / Q8_0 block with scale d and min m.
  template <DType T>
  static void decode(const uint8_t* blk, float d, float m, V* w) {
    if constexpr (T == DType::Q8_0) {
      w[0] = q8_values(reinterpret_cast<const int8_t*>(blk + 2), d);
      w[1] = q8_values(reinterpret_cast<const int8_t*>(blk + 18), d);
    } else {
      q4_values(blk + (T == DType::Q4_1 ? 4 : 2), q4_table<T>(d, m), w[0], w[1]);
    }
  }

  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }

  // The block types decoded through an L1 buffer (dequant_block, matmul_precise.h).
  template <DType T>
  static void dequant_q5(const uint8_t* blk, float* out) {
    detail::dequant_q5<T>(blk, out);
  }
  static void dequant_q4_k(const BlockQ4_K& b, float* out) { detail::dequant_q4_k(b, out); }
  static void dequant_q5_k(const BlockQ5_K& b, float* out) { detail::dequant_q5_k(b, out); }
  static void dequant_q6_k(const BlockQ6_K& b, float* out) { detail::dequant_q6_k(b, out); }

  // The sums of the first nr of kRows accumulators, with the float tiles' hsum4 tree.
  static void store_rows(const V* acc, int nr, float* out) {
    const __m256 s =
        _mm256_insertf128_ps(_mm256_castps128_ps256(hsum4(acc[0], acc[1], acc[2], acc[3])),
                             hsum4(acc[4], acc[5], acc[6], acc[7]), 1);
    _mm256_mask_storeu_ps(out, __mmask8((1u << nr) - 1), s);
  }
};

}  // namespace

size_t precise_scratch_bytes_avx512(int64_t K) {
  return precise::scratch_bytes<PreciseIsa>(K);
}

void matmul_precise_avx512(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  precise::matmul<PreciseIsa>(j, n0, n1, scratch);
}

}  // namespace ds::cpu::detail
