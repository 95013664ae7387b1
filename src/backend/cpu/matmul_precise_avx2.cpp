// AVX2 precise kernels: block-quantized weights against F32 activations.
//
// Same scheme as the AVX-512 file with 8-lane chunks: every weight is dequantized to one
// F32 value on every path,
//   Q4_0 d * (q - 8)   Q4_1 fma(d, q, m)   Q5_0 d * (q - 16)   Q5_1 fma(d, q, m)   Q8_0 d * q
//   Q4_K, Q5_K fma(d * sc, q, -(dmin * mn))                    Q6_K (d * sc) * (q - 32)
// and each output element accumulates fma(x, w, acc) over 8-lane chunks of k in order,
// then hsum4, exactly as the float tiles do. GEMV decodes the weights in registers; GEMM
// runs the float tiles on a panel of dequantized rows.
#include "backend/cpu/float_tile_avx2.h"

namespace ds::cpu::detail {
namespace {

constexpr int kRows = 4;
constexpr int kPrefetchBytes = 10 << 10;
constexpr int64_t kMBlock = 64;
constexpr int kChunk = 16;

constexpr int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}

template <DType T>
constexpr int kBlockBytes = T == DType::Q4_0   ? sizeof(BlockQ4_0)
                            : T == DType::Q4_1 ? sizeof(BlockQ4_1)
                            : T == DType::Q5_0 ? sizeof(BlockQ5_0)
                            : T == DType::Q5_1 ? sizeof(BlockQ5_1)
                            : T == DType::Q8_0 ? sizeof(BlockQ8_0)
                            : T == DType::Q4_K ? sizeof(BlockQ4_K)
                            : T == DType::Q5_K ? sizeof(BlockQ5_K)
                                               : sizeof(BlockQ6_K);
template <DType T>
constexpr int kBlockElems = T == DType::Q4_K || T == DType::Q5_K || T == DType::Q6_K ? 256 : 32;
template <DType T>
constexpr bool kDirect = T == DType::Q4_0 || T == DType::Q4_1 || T == DType::Q8_0;

inline float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

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

template <DType T>
void dequant_block(const uint8_t* blk, float* out) {
  if constexpr (T == DType::Q4_0 || T == DType::Q4_1) {
    __m256 v[4];
    q4_values<T>(blk + (T == DType::Q4_1 ? 4 : 2), h2f(blk), T == DType::Q4_1 ? h2f(blk + 2) : 0.0f,
                 v);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + 8 * c, v[c]);
  } else if constexpr (T == DType::Q8_0) {
    const float d = h2f(blk);
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_ps(out + 8 * c, q8_chunk(reinterpret_cast<const int8_t*>(blk + 2 + 8 * c), d));
  } else if constexpr (T == DType::Q5_0 || T == DType::Q5_1) {
    dequant_q5<T>(blk, out);
  } else if constexpr (T == DType::Q4_K) {
    dequant_q4_k(*reinterpret_cast<const BlockQ4_K*>(blk), out);
  } else if constexpr (T == DType::Q5_K) {
    dequant_q5_k(*reinterpret_cast<const BlockQ5_K*>(blk), out);
  } else {
    dequant_q6_k(*reinterpret_cast<const BlockQ6_K*>(blk), out);
  }
}

// ---- M == 1 ----

template <DType T>
void gemv_rows_small(const uint8_t* const* rows, int nr, const float* x, int64_t nb, float* out,
                     uint8_t* scratch) {
  auto* half = reinterpret_cast<uint32_t*>(scratch);      // [kChunk][kRows] (d, m) halves
  auto* dm = reinterpret_cast<float*>(scratch + 64 * 4);  // [kChunk][kRows][2]
  __m256 acc[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
    const int nc = int(imin(kChunk, nb - c0));
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < kRows; ++r) {
        uint32_t h;
        __builtin_memcpy(&h, rows[r] + (c0 + c) * kBlockBytes<T>, 4);
        half[c * kRows + r] = T == DType::Q4_1 ? h : (h & 0xffff);
      }
    for (int i = 0; i < nc * kRows * 2; i += 8)
      _mm256_store_ps(dm + i, _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(half + i / 2))));
    for (int c = 0; c < nc; ++c) {
      const int64_t b = c0 + c;
      __m256 xv[4];
      for (int k = 0; k < 4; ++k) xv[k] = _mm256_loadu_ps(x + 32 * b + 8 * k);
      DS_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* blk = rows[r] + b * kBlockBytes<T>;
        if (T == DType::Q8_0 || (b & 1) == 0)
          _mm_prefetch((const char*)(blk + kPrefetchBytes), _MM_HINT_T0);
        const float d = dm[(c * kRows + r) * 2];
        __m256 w[4];
        if constexpr (T == DType::Q8_0) {
          for (int k = 0; k < 4; ++k)
            w[k] = q8_chunk(reinterpret_cast<const int8_t*>(blk + 2 + 8 * k), d);
        } else {
          q4_values<T>(blk + (T == DType::Q4_1 ? 4 : 2), d, dm[(c * kRows + r) * 2 + 1], w);
        }
        for (int k = 0; k < 4; ++k) acc[r] = _mm256_fmadd_ps(xv[k], w[k], acc[r]);
      }
    }
  }
  alignas(16) float s[4];
  _mm_store_ps(s, hsum4(acc[0], acc[1], acc[2], acc[3]));
  for (int r = 0; r < nr; ++r) out[r] = s[r];
}

template <DType T>
void gemv_rows_buffered(const uint8_t* const* rows, int nr, const float* x, int64_t nb, float* out,
                        uint8_t* scratch) {
  constexpr int kE = kBlockElems<T>;
  auto* buf = reinterpret_cast<float*>(scratch);  // [kRows][kE]
  __m256 acc[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* blk = rows[r] + b * kBlockBytes<T>;
      for (int off = 0; off < kBlockBytes<T>; off += 64)
        _mm_prefetch((const char*)(blk + kPrefetchBytes + off), _MM_HINT_T0);
      dequant_block<T>(blk, buf + r * kE);
    }
    for (int k = 0; k < kE; k += 8) {
      const __m256 xv = _mm256_loadu_ps(x + b * kE + k);
      DS_UNROLL
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm256_fmadd_ps(xv, _mm256_load_ps(buf + r * kE + k), acc[r]);
    }
  }
  alignas(16) float s[4];
  _mm_store_ps(s, hsum4(acc[0], acc[1], acc[2], acc[3]));
  for (int r = 0; r < nr; ++r) out[r] = s[r];
}

template <DType T>
void gemv(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  const int64_t nb = j.K / kBlockElems<T>;
  const uint8_t* first = j.w + n0 * j.w_row_bytes;
  const int64_t lead = imin(kPrefetchBytes, (n1 - n0) * int64_t(j.w_row_bytes));
  for (int64_t off = 0; off < lead; off += 64)
    _mm_prefetch((const char*)(first + off), _MM_HINT_T0);
  for (int64_t n = n0; n < n1; n += kRows) {
    const int nr = int(imin(kRows, n1 - n));
    const uint8_t* rows[kRows];  // rows past nr repeat the last one; their sums are dropped
    for (int r = 0; r < kRows; ++r) rows[r] = j.w + (n + imin(r, nr - 1)) * j.w_row_bytes;
    if constexpr (kDirect<T>)
      gemv_rows_small<T>(rows, nr, j.x, nb, j.out + n, scratch);
    else
      gemv_rows_buffered<T>(rows, nr, j.x, nb, j.out + n, scratch);
  }
}

// ---- M > 1 ----

template <DType T>
void gemm(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  using ftiles::kNR;
  auto* panel = reinterpret_cast<float*>(scratch);  // [kNR][K]
  const int64_t nb = j.K / kBlockElems<T>;
  const size_t panel_row = size_t(j.K) * 4;
  for (int64_t m0 = 0; m0 < j.M; m0 += kMBlock) {
    const int64_t m1 = imin(j.M, m0 + kMBlock);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int nr = int(imin(kNR, n1 - n));
      for (int r = 0; r < nr; ++r) {
        const uint8_t* row = j.w + (n + r) * j.w_row_bytes;
        for (int64_t b = 0; b < nb; ++b)
          dequant_block<T>(row + b * kBlockBytes<T>, panel + r * j.K + b * kBlockElems<T>);
      }
      const auto* w = reinterpret_cast<const uint8_t*>(panel);
      for (int64_t m = m0; m < m1; m += 2) {
        const FTileFn fn = m + 1 < m1 ? ftile_for<DType::F32, 2>(nr) : ftile_for<DType::F32, 1>(nr);
        fn(j.x + m * j.ldx, j.ldx, w, panel_row, j.K, j.out + m * j.ldo + n, j.ldo);
      }
    }
  }
}

template <DType T>
void run(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  if (j.M == 1)
    gemv<T>(j, n0, n1, scratch);
  else
    gemm<T>(j, n0, n1, scratch);
}

}  // namespace

size_t precise_scratch_bytes_avx2(int64_t K) {
  const size_t gemv = size_t(kRows) * 256 * 4, panel = size_t(ftiles::kNR) * size_t(K) * 4;
  return panel > gemv ? panel : gemv;
}

void matmul_precise_avx2(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  switch (j.wtype) {
    case DType::Q4_0:
      return run<DType::Q4_0>(j, n0, n1, scratch);
    case DType::Q4_1:
      return run<DType::Q4_1>(j, n0, n1, scratch);
    case DType::Q8_0:
      return run<DType::Q8_0>(j, n0, n1, scratch);
    case DType::Q5_0:
      return run<DType::Q5_0>(j, n0, n1, scratch);
    case DType::Q5_1:
      return run<DType::Q5_1>(j, n0, n1, scratch);
    case DType::Q4_K:
      return run<DType::Q4_K>(j, n0, n1, scratch);
    case DType::Q5_K:
      return run<DType::Q5_K>(j, n0, n1, scratch);
    default:
      return run<DType::Q6_K>(j, n0, n1, scratch);
  }
}

}  // namespace ds::cpu::detail
