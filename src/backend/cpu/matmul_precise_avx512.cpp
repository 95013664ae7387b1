// AVX-512 precise kernels: block-quantized weights against F32 activations.
//
// Every weight is dequantized to the same F32 value on every path (dequant_block and the
// GEMV's in-register decoding share the helpers below):
//   Q4_0 d * (q - 8)   Q4_1 fma(d, q, m)   Q5_0 d * (q - 16)   Q5_1 fma(d, q, m)   Q8_0 d * q
//   Q4_K, Q5_K fma(d * sc, q, -(dmin * mn))                    Q6_K (d * sc) * (q - 32)
// and each output element accumulates fma(x, w, acc) over 16-lane chunks of k in order,
// then hsum4: exactly the float tiles' sequence. GEMV (M == 1) decodes the weights in
// registers as they stream from DRAM; GEMM dequantizes a panel of weight rows once into
// an L1-resident buffer and runs the float tiles on it. Both give the same bits.
#include "backend/cpu/float_tile_avx512.h"

namespace ds::cpu::detail {
namespace {

constexpr int kRows = 8;                  // GEMV weight rows per pass (hides FMA latency)
constexpr int kPrefetchBytes = 10 << 10;  // GEMV software prefetch distance
constexpr int64_t kMBlock = 64;           // GEMM activation rows per pass over a panel
constexpr int kChunk = 16;                // GEMV blocks whose scales are converted at once

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
// Types the GEMV decodes straight into registers; the others go through an L1 buffer.
template <DType T>
constexpr bool kDirect = T == DType::Q4_0 || T == DType::Q4_1 || T == DType::Q8_0;

inline float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

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

// One block of type T to kBlockElems<T> floats.
template <DType T>
void dequant_block(const uint8_t* blk, float* out) {
  if constexpr (T == DType::Q4_0 || T == DType::Q4_1) {
    const float d = h2f(blk), m = T == DType::Q4_1 ? h2f(blk + 2) : 0.0f;
    __m512 lo, hi;
    q4_values(blk + (T == DType::Q4_1 ? 4 : 2), q4_table<T>(d, m), lo, hi);
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
  } else if constexpr (T == DType::Q8_0) {
    const float d = h2f(blk);
    const auto* qs = reinterpret_cast<const int8_t*>(blk + 2);
    _mm512_storeu_ps(out, q8_values(qs, d));
    _mm512_storeu_ps(out + 16, q8_values(qs + 16, d));
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

// The sums of the first nr of kRows accumulators, with the float tiles' hsum4 tree.
inline void store_rows(const __m512* acc, int nr, float* out) {
  static_assert(kRows == 8);
  const __m256 s =
      _mm256_insertf128_ps(_mm256_castps128_ps256(hsum4(acc[0], acc[1], acc[2], acc[3])),
                           hsum4(acc[4], acc[5], acc[6], acc[7]), 1);
  _mm256_mask_storeu_ps(out, __mmask8((1u << nr) - 1), s);
}

// Q4_0 / Q4_1 / Q8_0: kRows rows decoded in registers. Their block scales (and mins) are
// first copied kChunk blocks at a time and converted 16 halves per instruction.
template <DType T>
void gemv_rows_small(const uint8_t* const* rows, int nr, const float* x, int64_t nb, float* out,
                     uint8_t* scratch) {
  auto* half = reinterpret_cast<uint32_t*>(scratch);                  // [kChunk][kRows] halves
  auto* dm = reinterpret_cast<float*>(scratch + kChunk * kRows * 4);  // [kChunk][kRows][2]
  __m512 acc[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
    const int nc = int(imin(kChunk, nb - c0));
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < kRows; ++r) {
        uint32_t h;
        __builtin_memcpy(&h, rows[r] + (c0 + c) * kBlockBytes<T>, 4);
        half[c * kRows + r] = T == DType::Q4_1 ? h : (h & 0xffff);
      }
    for (int i = 0; i < nc * kRows * 2; i += 16)
      _mm512_store_ps(dm + i, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(half + i / 2))));
    for (int c = 0; c < nc; ++c) {
      const int64_t b = c0 + c;
      const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
      DS_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* blk = rows[r] + b * kBlockBytes<T>;
        if (T == DType::Q8_0 || (b & 1) == 0)  // once per 64 bytes of each row
          _mm_prefetch((const char*)(blk + kPrefetchBytes), _MM_HINT_T0);
        const float d = dm[(c * kRows + r) * 2];
        __m512 lo, hi;
        if constexpr (T == DType::Q8_0) {
          lo = q8_values(reinterpret_cast<const int8_t*>(blk + 2), d);
          hi = q8_values(reinterpret_cast<const int8_t*>(blk + 18), d);
        } else {
          const float m = dm[(c * kRows + r) * 2 + 1];
          q4_values(blk + (T == DType::Q4_1 ? 4 : 2), q4_table<T>(d, m), lo, hi);
        }
        acc[r] = _mm512_fmadd_ps(x0, lo, acc[r]);
        acc[r] = _mm512_fmadd_ps(x1, hi, acc[r]);
      }
    }
  }
  store_rows(acc, nr, out);
}

// The other types: each block of kRows rows dequantized into an L1 buffer, then the FMAs.
template <DType T>
void gemv_rows_buffered(const uint8_t* const* rows, int nr, const float* x, int64_t nb, float* out,
                        uint8_t* scratch) {
  constexpr int kE = kBlockElems<T>;
  auto* buf = reinterpret_cast<float*>(scratch);  // [kRows][kE]
  __m512 acc[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* blk = rows[r] + b * kBlockBytes<T>;
      for (int off = 0; off < kBlockBytes<T>; off += 64)
        _mm_prefetch((const char*)(blk + kPrefetchBytes + off), _MM_HINT_T0);
      dequant_block<T>(blk, buf + r * kE);
    }
    for (int k = 0; k < kE; k += 16) {
      const __m512 xv = _mm512_loadu_ps(x + b * kE + k);
      DS_UNROLL
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_fmadd_ps(xv, _mm512_load_ps(buf + r * kE + k), acc[r]);
    }
  }
  store_rows(acc, nr, out);
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

// ---- M > 1: panels of dequantized rows under the float tiles ----

template <DType T>
void gemm(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  using ftiles::kMR;
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
      for (int64_t m = m0; m < m1; m += kMR)
        ftile_for<DType::F32>(int(imin(kMR, m1 - m)), nr)(j.x + m * j.ldx, j.ldx, w, panel_row, j.K,
                                                          j.out + m * j.ldo + n, j.ldo);
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

size_t precise_scratch_bytes_avx512(int64_t K) {
  const size_t gemv = size_t(kRows) * 256 * 4 + 64, panel = size_t(ftiles::kNR) * size_t(K) * 4;
  return panel > gemv ? panel : gemv;
}

void matmul_precise_avx512(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
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
