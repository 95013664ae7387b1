// AVX-512 VNNI kernels for Q4_0 / Q4_1 / Q8_0 weights against 8-bit activations.
//
// Two weight rows share one zmm: lanes 0..7 hold block b of row n, lanes 8..15 block b of
// row n + 1, so one vpdpbusd against the activation block broadcast to both halves gives
// each row's eight exact int32 lane sums (lane u: elements 4u..4u+3). Every output element
// then runs llama.cpp's AVX2 vec_dot sequence, block by block:
//   acc = fma(dw * dx, float(lanes), acc)   (8 lanes)   Q4_1: summs = fma(m, s, summs)
// and the result is hsum8(acc) [+ summs]. GEMV (M == 1) and the register tiles differ only
// in where the weights come from (the row itself or a packed panel), so batched results
// equal single-row ones.
//
// Weights are the unsigned vpdpbusd operand (Q4 nibbles 0..15, Q8_0 q + 128) and the
// activations the signed one; the activation row carries the integer lane corrections
// (-8 or -128 times the lane sums of q) that undo the offsets.
#include "backend/cpu/matmul_common.h"
#include "backend/cpu/simd_avx512.h"

namespace ds::cpu::detail {
namespace {

constexpr int kMR = 4, kNP = 4;  // tile: activation rows x weight-row pairs
// GEMV software prefetch distance: DRAM latency times per-core bandwidth, with margin.
constexpr int kPrefetchBytes = 10 << 10;
constexpr size_t kXBlockBytes = 256 << 10;  // activation rows kept hot in L2 per pass

// Local helper instead of std::max, as imin (matmul_common.h).
constexpr int64_t imax(int64_t a, int64_t b) {
  return a > b ? a : b;
}

// Row: q [nb][32] int8, c [nb][8] int32, d [nb] F32, s [nb] F32.
Q8Layout layout(int64_t K) {
  const int64_t nb = K / 32;
  Q8Layout l;
  l.nb = nb;
  l.c_off = size_t(nb) * 32;
  l.d_off = l.c_off + size_t(nb) * 32;
  l.s_off = (l.d_off + size_t(nb) * 4 + 63) / 64 * 64;
  l.row_bytes = (l.s_off + size_t(nb) * 4 + 63) / 64 * 64;
  return l;
}

void quantize_q8(const float* x, int64_t K, DType wtype, uint8_t* row) {
  const Q8Layout l = layout(K);
  auto* d = reinterpret_cast<float*>(row + l.d_off);
  auto* s = reinterpret_cast<float*>(row + l.s_off);
  // The weights' offset the corrections undo: Q4_0 stores q + 8, Q8_0 is fed to vpdpbusd
  // as q + 128, Q4_1 has none (its corrections stay zero and are never read).
  const __m256i offset = _mm256_set1_epi8(wtype == DType::Q4_0   ? char(8)
                                          : wtype == DType::Q8_0 ? char(0x80)
                                                                 : char(0));
  for (int64_t b = 0; b < l.nb; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    // 127 / amax and half-to-even rounding, as llama.cpp's quantize_row_q8_0 / q8_1.
    const __m512 id = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvttps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, id), kRne));
    const __m512i q1 = _mm512_cvttps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, id), kRne));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q0)),
                                              _mm512_cvtepi32_epi8(q1), 1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(row + 32 * b), q);
    const __m256i c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), offset, q);
    _mm256_store_si256(reinterpret_cast<__m256i*>(row + l.c_off + 32 * b),
                       _mm256_sub_epi32(_mm256_setzero_si256(), c));
    const float dd = amax / 127.0f;
    d[b] = _cvtsh_ss(_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT));
    s[b] = _cvtsh_ss(_cvtss_sh(dd * float(sum), _MM_FROUND_TO_NEAREST_INT));
  }
}

// ---- weights ----

// Block b of rows a and b2 (pointers to the blocks): w = their 32 values as the unsigned
// operand, row a in bytes 0..31, row b2 in 32..63, in element order; f = [d_a, m_a, d_b,
// m_b] as F32 (m = 0 unless Q4_1).
template <DType T>
inline void load_pair(const uint8_t* a, const uint8_t* b2, __m512i& w, __m128& f) {
  if constexpr (T == DType::Q8_0) {
    const __m512i v =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + 2))),
                           _mm256_loadu_si256((const __m256i*)(b2 + 2)), 1);
    w = _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));
  } else {
    constexpr int kQs = T == DType::Q4_1 ? 4 : 2;
    const __m256i v =
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(a + kQs))),
                                _mm_loadu_si128((const __m128i*)(b2 + kQs)), 1);
    // 128-bit lanes [a, a, b2, b2]; the second of each pair shifted to its high nibbles.
    const __m512i t = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                               _mm512_castsi256_si512(v));
    w = _mm512_and_si512(_mm512_mask_srli_epi16(t, __mmask32(0xff00ff00u), t, 4),
                         _mm512_set1_epi8(0x0f));
  }
  uint32_t ha, hb;
  __builtin_memcpy(&ha, a, 4);
  __builtin_memcpy(&hb, b2, 4);
  if constexpr (T != DType::Q4_1) {  // only d: the next two bytes are quants
    ha &= 0xffff;
    hb &= 0xffff;
  }
  f = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(int(ha)), int(hb), 1));
}

// [d_a x 8, d_b x 8] from load_pair's f.
inline __m512 pair_scales(__m128 f) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                               _mm512_castps128_ps512(f));
}

// hsum8 of both halves of four row-pair accumulators: the eight row results in order, each
// ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) over its own lanes like llama.cpp's hsum_float_8.
inline __m256 hsum8x8(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1)));
  // Per 128-bit lane k: rows k of ab (t0, t1) and of cd.
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane k of u holds row k (from ab) in element 0 and row 4 + k (from cd) in element 1.
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, u));
}

// One row's activations as the kernels read them.
struct XRow {
  const uint8_t* q;  // [nb][32]
  const uint8_t* c;  // [nb][32]
  const float* d;    // [nb]
  const float* s;    // [nb]
};

inline XRow x_row(const uint8_t* row, const Q8Layout& l) {
  return {row, row + l.c_off, reinterpret_cast<const float*>(row + l.d_off),
          reinterpret_cast<const float*>(row + l.s_off)};
}

template <DType T>
inline __m512i x_corrections(const XRow& x, int64_t b) {
  if constexpr (T == DType::Q4_1) return _mm512_setzero_si512();
  return _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i*)(x.c + 32 * b)));
}

// Stores the first nr of eight results.
inline void store_results(float* out, __m256 r, int nr) {
  _mm256_mask_storeu_ps(out, __mmask8((1u << nr) - 1), r);
}

// ---- M == 1: stream 2 * NP weight rows against one activation row ----

template <DType T, int NP>
void gemv_rows(const uint8_t* const* rows, int nr, int64_t nb, const XRow& x, float* out) {
  __m512 acc[NP];
  __m128 summs[NP];  // Q4_1: lanes 1 and 3 run the two rows' min-term chains
  DS_UNROLL
  for (int p = 0; p < NP; ++p) {
    acc[p] = _mm512_setzero_ps();
    summs[p] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i xv = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i*)(x.q + 32 * b)));
    const __m512i cx = x_corrections<T>(x, b);
    const __m512 dx = _mm512_set1_ps(x.d[b]);
    DS_UNROLL
    for (int p = 0; p < NP; ++p) {
      const uint8_t* ba = rows[2 * p] + b * kBlockBytes<T>;
      const uint8_t* bb = rows[2 * p + 1] + b * kBlockBytes<T>;
      // The weights stream from DRAM: fetch 10 KiB ahead (the hardware prefetcher alone
      // leaves a core at half the bandwidth); once per 64 bytes of each row.
      if (T == DType::Q8_0 || (b & 1) == 0) {
        _mm_prefetch((const char*)(ba + kPrefetchBytes), _MM_HINT_T0);
        _mm_prefetch((const char*)(bb + kPrefetchBytes), _MM_HINT_T0);
      }
      __m512i w;
      __m128 f;
      load_pair<T>(ba, bb, w, f);
      const __m512 dd = _mm512_mul_ps(pair_scales(f), dx);
      acc[p] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cx, w, xv)), acc[p]);
      if constexpr (T == DType::Q4_1) summs[p] = _mm_fmadd_ps(f, _mm_set1_ps(x.s[b]), summs[p]);
    }
  }
  const __m512 z = _mm512_setzero_ps();
  __m256 r = hsum8x8(acc[0], NP > 1 ? acc[NP > 1 ? 1 : 0] : z, z, z);
  if constexpr (T == DType::Q4_1) {
    const __m128 s01 = summs[0], s23 = summs[NP > 1 ? 1 : 0];
    r = _mm256_add_ps(r, _mm256_castps128_ps256(_mm_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 1, 3, 1))));
  }
  store_results(out, r, nr);
}

template <DType T>
void gemv(const Q8Job& j, int64_t n0, int64_t n1) {
  const XRow x = x_row(j.xq, j.lay);
  // Start the stream: the in-loop prefetches run kPrefetchBytes ahead of the first rows.
  const uint8_t* first = j.w + n0 * j.w_row_bytes;
  const int64_t lead = imin(kPrefetchBytes, (n1 - n0) * int64_t(j.w_row_bytes));
  for (int64_t off = 0; off < lead; off += 64)
    _mm_prefetch((const char*)(first + off), _MM_HINT_T0);
  for (int64_t n = n0; n < n1; n += 4) {
    const int nr = int(imin(4, n1 - n));
    const uint8_t* rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = j.w + (n + imin(r, nr - 1)) * j.w_row_bytes;
    if (nr > 2)
      gemv_rows<T, 2>(rows, nr, j.lay.nb, x, j.out + n);
    else
      gemv_rows<T, 1>(rows, nr, j.lay.nb, x, j.out + n);
  }
}

// ---- M > 1: 2 * kNP weight rows packed once, reused by every kMR-row activation tile ----

struct Panel {
  __m512i* w;  // [nb][kNP] unsigned weights, a row pair per zmm
  __m512* dw;  // [nb][kNP] [d_a x 8, d_b x 8]
  float* m;    // [nb][2 * kNP] Q4_1 mins
  Panel(uint8_t* p, int64_t nb)
      : w(reinterpret_cast<__m512i*>(p)),
        dw(reinterpret_cast<__m512*>(w + nb * kNP)),
        m(reinterpret_cast<float*>(dw + nb * kNP)) {}
  static size_t bytes(int64_t nb) { return size_t(nb) * (kNP * 128 + 2 * kNP * 4); }
};

template <DType T>
void pack_panel(const uint8_t* const* rows, int64_t nb, const Panel& pan) {
  for (int64_t b = 0; b < nb; ++b)
    for (int p = 0; p < kNP; ++p) {
      __m512i w;
      __m128 f;
      load_pair<T>(rows[2 * p] + b * kBlockBytes<T>, rows[2 * p + 1] + b * kBlockBytes<T>, w, f);
      pan.w[b * kNP + p] = w;
      pan.dw[b * kNP + p] = pair_scales(f);
      alignas(16) float v[4];
      _mm_store_ps(v, f);
      pan.m[b * 2 * kNP + 2 * p] = v[1];
      pan.m[b * 2 * kNP + 2 * p + 1] = v[3];
    }
}

template <DType T, int MR>
void tile(const uint8_t* x, const Q8Layout& lay, const Panel& pan, int nr, float* out,
          int64_t ldo) {
  const int64_t nb = lay.nb;
  XRow xr[MR];
  DS_UNROLL
  for (int i = 0; i < MR; ++i) xr[i] = x_row(x + i * lay.row_bytes, lay);
  __m512 acc[MR][kNP];
  __m256 summs[MR];  // Q4_1: one min-term chain per column
  DS_UNROLL
  for (int i = 0; i < MR; ++i) {
    summs[i] = _mm256_setzero_ps();
    DS_UNROLL
    for (int p = 0; p < kNP; ++p) acc[i][p] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m512i xv[MR], cx[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) {
      xv[i] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i*)(xr[i].q + 32 * b)));
      cx[i] = x_corrections<T>(xr[i], b);
    }
    DS_UNROLL
    for (int p = 0; p < kNP; ++p) {
      const __m512i w = pan.w[b * kNP + p];
      const __m512 dw = pan.dw[b * kNP + p];
      DS_UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(xr[i].d[b]));
        const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cx[i], w, xv[i]));
        acc[i][p] = _mm512_fmadd_ps(dd, lanes, acc[i][p]);
      }
    }
    if constexpr (T == DType::Q4_1) {
      const __m256 mv = _mm256_load_ps(pan.m + b * 2 * kNP);
      DS_UNROLL
      for (int i = 0; i < MR; ++i)
        summs[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xr[i].s[b]), summs[i]);
    }
  }
  DS_UNROLL
  for (int i = 0; i < MR; ++i) {
    __m256 r = hsum8x8(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    if constexpr (T == DType::Q4_1) r = _mm256_add_ps(r, summs[i]);
    store_results(out + i * ldo, r, nr);
  }
}
static_assert(kNP == 4, "tile's hsum8x8 takes four row pairs");

template <DType T>
using TileFn = void (*)(const uint8_t*, const Q8Layout&, const Panel&, int, float*, int64_t);

template <DType T>
TileFn<T> tile_for(int mr) {
  switch (mr) {
    case 4:
      return tile<T, 4>;
    case 3:
      return tile<T, 3>;
    case 2:
      return tile<T, 2>;
    default:
      return tile<T, 1>;
  }
}

template <DType T>
void gemm(const Q8Job& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  const Panel pan(scratch, j.lay.nb);
  constexpr int kNR = 2 * kNP;
  const int64_t mb = imax(kMR, int64_t(kXBlockBytes / j.lay.row_bytes) / kMR * kMR);
  for (int64_t m0 = 0; m0 < j.M; m0 += mb) {
    const int64_t m1 = imin(j.M, m0 + mb);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int nr = int(imin(kNR, n1 - n));
      const uint8_t* rows[kNR];  // rows past nr repeat the last one; their results are dropped
      for (int r = 0; r < kNR; ++r) rows[r] = j.w + (n + imin(r, nr - 1)) * j.w_row_bytes;
      pack_panel<T>(rows, j.lay.nb, pan);
      int64_t m = m0;
      for (; m + kMR <= m1; m += kMR)
        tile<T, kMR>(j.xq + m * j.lay.row_bytes, j.lay, pan, nr, j.out + m * j.ldo + n, j.ldo);
      if (m < m1)
        tile_for<T>(int(m1 - m))(j.xq + m * j.lay.row_bytes, j.lay, pan, nr, j.out + m * j.ldo + n,
                                 j.ldo);
    }
  }
}

template <DType T>
void run(const Q8Job& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  if (j.M == 1)
    gemv<T>(j, n0, n1);
  else
    gemm<T>(j, n0, n1, scratch);
}

void matmul_q8(const Q8Job& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  with_type<DType::Q4_0, DType::Q4_1, DType::Q8_0>(
      j.wtype, [&](auto t) { run<decltype(t)::value>(j, n0, n1, scratch); });
}

size_t scratch_bytes(int64_t K) {
  return Panel::bytes(K / 32);
}

}  // namespace

const Kernels& kernels_avx512() {
  static constexpr Kernels k = {layout,
                                quantize_q8,
                                scratch_bytes,
                                matmul_q8,
                                matmul_float_avx512,
                                matmul_k_avx2,
                                precise_scratch_bytes_avx512,
                                matmul_precise_avx512};
  return k;
}

}  // namespace ds::cpu::detail
