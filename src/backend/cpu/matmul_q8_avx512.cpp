// AVX-512 VNNI kernels for Q4_0 / Q4_1 / Q8_0 weights against 8-bit activations.
//
// Two blocks share one zmm: dword lane 2u+b holds elements 4u..4u+3 of block b of the
// pair, so a vpdpbusd leaves per-block partial sums in alternating lanes and the two block
// scales broadcast as one 64-bit pair. Activations are stored as q + 128 (unsigned).
//
// Every output element runs the same float sequence on every path: for each block pair p
//   acc = fma(float(lanes_p), dw_p * dx_p, acc)          (16 lanes)
//   Q4_1: (lo, hi) = fma((m_2p, m_2p+1), (s_2p, s_2p+1), (lo, hi))
// where lanes_p are exact int32 sums of x_q * w_q over the lane's four elements, and the
// result is hsum4(acc) [+ (lo + hi)]. GEMV (M == 1) and the register tiles differ only in
// how they form the exact integer lanes, so batched results equal single-row ones.
#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/simd_avx512.h"

namespace ds::cpu::detail {
namespace {

constexpr int kMR = 4, kNR = 4;
// GEMV software prefetch distance: DRAM latency times per-core bandwidth, with margin.
constexpr int kPrefetchBytes = 10 << 10;

// Local helpers instead of std::min/max: no library template gets instantiated with
// AVX-512 flags and then merged by the linker into code that runs on other CPUs.
constexpr int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}
constexpr int64_t imax(int64_t a, int64_t b) {
  return a > b ? a : b;
}
template <bool V>
struct Bool {
  static constexpr bool value = V;
};
constexpr size_t kXBlockBytes = 256 << 10;  // activation rows kept hot in L2 per pass

struct Dims {
  int64_t nb, np;  // blocks, block pairs
  explicit Dims(int64_t K) : nb(K / 32), np((K / 32 + 1) / 2) {}
};

Q8Layout layout(int64_t K) {
  const Dims dm(K);
  Q8Layout l;
  l.nb = dm.nb;
  l.d_off = size_t(dm.np) * 64;
  l.s_off = (l.d_off + size_t(dm.np) * 8 + 63) / 64 * 64;
  l.row_bytes = (l.s_off + size_t(dm.np) * 8 + 63) / 64 * 64;
  return l;
}

// Rounds half away from zero, bit-exact with roundf.
inline __m512i round_away(__m512 v) {
  const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m512 frac = _mm512_sub_ps(v, t);
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(frac), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __m512 one = _mm512_or_ps(_mm512_and_ps(v, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(1.0f));
  return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, one));
}

// One block of 32 floats -> 32 int8 as quantize_block_q8 computes them.
inline __m256i quant_block(const float* x, float* d_out, int* sum_out) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512i q0 = round_away(_mm512_mul_ps(v0, id)), q1 = round_away(_mm512_mul_ps(v1, id));
  *sum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  *d_out = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q0)),
                                 _mm512_cvtepi32_epi8(q1), 1);
}

inline __m512i pair_index() {
  return _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}

void quantize_q8(const float* x, int64_t K, uint8_t* row) {
  const Dims dm(K);
  const Q8Layout l = layout(K);
  auto* d = reinterpret_cast<float*>(row + l.d_off);
  auto* s = reinterpret_cast<float*>(row + l.s_off);
  const __m512i idx = pair_index(), bias = _mm512_set1_epi8(char(0x80));
  for (int64_t p = 0; p < dm.np; ++p) {
    __m256i q[2];
    for (int b = 0; b < 2; ++b) {
      const int64_t blk = 2 * p + b;
      if (blk < dm.nb) {
        int sum;
        q[b] = quant_block(x + 32 * blk, &d[blk], &sum);
        s[blk] = d[blk] * float(sum);
      } else {  // the missing half of the last pair: q = 0 contributes nothing
        q[b] = _mm256_setzero_si256();
        d[blk] = s[blk] = 0.0f;
      }
    }
    const __m512i z =
        _mm512_permutex2var_epi32(_mm512_castsi256_si512(q[0]), idx, _mm512_castsi256_si512(q[1]));
    _mm512_store_si512(row + 64 * p, _mm512_xor_si512(z, bias));
  }
}

// ---- weights ----

template <DType T>
constexpr int kBlockBytes = T == DType::Q4_0   ? 18
                            : T == DType::Q4_1 ? 20
                                               : 34;

// Bytes [0, n) set, for masked loads that never touch memory past a row's last block.
constexpr __mmask64 bytes_mask(int n) {
  return n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
}

// 64 bytes from p; only the first n are needed. Unless kMasked, the rest must be readable
// (an unmasked load is much faster when the weights stream from DRAM).
template <bool kMasked>
inline __m512i load_bytes(const uint8_t* p, int n) {
  if constexpr (kMasked) return _mm512_maskz_loadu_epi8(bytes_mask(n), p);
  return _mm512_loadu_si512(p);
}

// Block pair (blk, blk + 1) straight from the weight row, in one or two loads:
// w = raw values in pair lane order (Q4 nibbles 0..15, Q8 int8); dm = [d0, m0, d1, m1]
// as F32 (Q4_1), [d0, d0, d1, d1] otherwise. kTwo = false for an odd last block, whose
// missing partner reads as zeros. kMasked: never read past the pair (the row's end).
template <DType T, bool kTwo, bool kMasked = true>
inline void load_pair(const uint8_t* blk, __m512i& w, __m128& dm) {
  constexpr int kBytes = kBlockBytes<T> * (kTwo ? 2 : 1);
  constexpr bool kMask = kMasked || !kTwo;
  if constexpr (T == DType::Q4_1) {
    // Dwords: 0 = (d0, m0), 1..4 = qs0, 5 = (d1, m1), 6..9 = qs1.
    const __m512i z = load_bytes<kMask>(blk, kBytes);
    const __m512i t = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(1, 6, 2, 7, 3, 8, 4, 9, 1, 6, 2, 7, 3, 8, 4, 9), z);
    w = _mm512_and_si512(_mm512_mask_srli_epi16(t, __mmask32(0xffff0000u), t, 4),
                         _mm512_set1_epi8(0x0f));
    const __m512i h = _mm512_permutexvar_epi32(_mm512_set1_epi64(int64_t(5) << 32), z);
    dm = _mm_cvtph_ps(_mm512_castsi512_si128(h));
  } else if constexpr (T == DType::Q4_0) {
    // Words: 0 = d0, 1..8 = qs0, 9 = d1, 10..17 = qs1.
    const __m512i z = load_bytes<kMask>(blk, kBytes);
    const __m512i t = _mm512_permutexvar_epi16(
        _mm512_set_epi16(17, 16, 8, 7, 15, 14, 6, 5, 13, 12, 4, 3, 11, 10, 2, 1,  //
                         17, 16, 8, 7, 15, 14, 6, 5, 13, 12, 4, 3, 11, 10, 2, 1),
        z);
    w = _mm512_and_si512(_mm512_mask_srli_epi16(t, __mmask32(0xffff0000u), t, 4),
                         _mm512_set1_epi8(0x0f));
    const __m512i h = _mm512_permutexvar_epi16(_mm512_set1_epi64(0x0009000900000000ll), z);
    dm = _mm_cvtph_ps(_mm512_castsi512_si128(h));
  } else {
    // Bytes: 0 = d0, 2..33 = qs0, 34 = d1, 36..67 = qs1: loads that stay inside the pair.
    const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(blk + 2)));
    const __m512i b = kTwo ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(blk + 36)))
                           : _mm512_setzero_si512();
    w = _mm512_permutex2var_epi32(a, pair_index(), b);
    uint16_t d0, d1 = 0;
    __builtin_memcpy(&d0, blk, 2);
    if constexpr (kTwo) __builtin_memcpy(&d1, blk + 34, 2);
    dm = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(d0), d1, 2));
  }
}

// [d0, d1] repeated over 16 lanes from load_pair's dm.
inline __m512 scale_pair(__m128 dm) {
  return _mm512_permutexvar_ps(_mm512_set1_epi64(int64_t(2) << 32), _mm512_castps128_ps512(dm));
}

// Weights as the unsigned vpdpbusd operand (GEMV): Q4 nibbles as they are, Q8 + 128.
template <DType T>
inline __m512i to_unsigned(__m512i w) {
  if constexpr (T == DType::Q8_0) return _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80)));
  return w;
}

// Weights as the signed operand (tiles): Q4_0 q - 8, Q4_1 q, Q8_0 as stored.
template <DType T>
inline __m512i to_signed(__m512i w) {
  if constexpr (T == DType::Q4_0) return _mm512_sub_epi8(w, _mm512_set1_epi8(8));
  return w;
}

inline __m512 accumulate(__m512 acc, __m512i lanes, __m512 dw, __m512 dx) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(dw, dx), acc);
}

// ---- M == 1: stream NR weight rows against one activation row ----

struct GemvX {
  const uint8_t* xs;  // [np, 64] signed q
  const uint8_t* xc;  // [np, 64] int32 lane corrections (Q4_0: -8 sum x, Q8_0: -128 sum x)
  const float* d;     // [np * 2]
  const float* s;     // [np * 2]
};

template <DType T, int NR>
void gemv_rows(const uint8_t* w, size_t wrb, const Dims& dm, const GemvX& x, float* out) {
  __m512 acc[NR];
  __m128 macc[NR];  // Q4_1: lanes 1 and 3 hold the (lo, hi) min-term sums
  DS_UNROLL
  for (int j = 0; j < NR; ++j) {
    acc[j] = _mm512_setzero_ps();
    macc[j] = _mm_setzero_ps();
  }
  auto step = [&](int64_t p, auto two, auto masked) {
    const __m512i xv = _mm512_load_si512(x.xs + 64 * p);
    const __m512 dx = broadcast_pair(x.d + 2 * p);
    const __m512i c = T == DType::Q4_1 ? _mm512_setzero_si512() : _mm512_load_si512(x.xc + 64 * p);
    const __m128 sx =
        _mm_unpacklo_ps(_mm_setzero_ps(), _mm_castpd_ps(_mm_load_sd((const double*)(x.s + 2 * p))));
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      // The weights streamed from DRAM: fetch 10 KiB ahead (the hardware prefetcher alone
      // leaves a core at half the bandwidth); a Q8_0 pair spans more than one line.
      const uint8_t* ahead = w + j * wrb + 2 * p * kBlockBytes<T> + kPrefetchBytes;
      _mm_prefetch((const char*)ahead, _MM_HINT_T0);
      if constexpr (2 * kBlockBytes < T >> 64) _mm_prefetch((const char*)(ahead + 64), _MM_HINT_T0);
      __m512i wv;
      __m128 dmv;
      load_pair<T, decltype(two)::value, decltype(masked)::value>(
          w + j * wrb + 2 * p * kBlockBytes<T>, wv, dmv);
      acc[j] =
          accumulate(acc[j], _mm512_dpbusd_epi32(c, to_unsigned<T>(wv), xv), scale_pair(dmv), dx);
      if constexpr (T == DType::Q4_1) macc[j] = _mm_fmadd_ps(dmv, sx, macc[j]);
    }
  };
  // Unmasked pair loads read 64 bytes: only where that much of the row is left.
  const int64_t full = dm.nb / 2, row = dm.nb * kBlockBytes<T>;
  const int64_t fast = row < 64 ? 0 : imin(full, (row - 64) / (2 * kBlockBytes<T>) + 1);
  for (int64_t p = 0; p < fast; ++p) step(p, Bool<true>{}, Bool<false>{});
  for (int64_t p = fast; p < full; ++p) step(p, Bool<true>{}, Bool<true>{});
  if (full < dm.np) step(full, Bool<false>{}, Bool<true>{});
  if constexpr (T == DType::Q4_1) {
    alignas(16) float h[4];
    _mm_store_ps(h, hsum4(acc[0], NR > 1 ? acc[1] : acc[0], NR > 2 ? acc[2] : acc[0],
                          NR > 3 ? acc[3] : acc[0]));
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      alignas(16) float mv[4];
      _mm_store_ps(mv, macc[j]);
      out[j] = h[j] + (mv[1] + mv[3]);
    }
  } else {
    DS_STORE_SUMS(NR, out, acc);
  }
}

template <DType T>
void gemv(const Q8Job& j, const Dims& dm, int64_t n0, int64_t n1, uint8_t* scratch) {
  auto* xs = scratch;
  auto* xc = xs + dm.np * 64;
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  const __m512i scale = _mm512_set1_epi8(T == DType::Q4_0 ? 8 : char(0x80));
  for (int64_t p = 0; p < dm.np; ++p) {
    const __m512i v = _mm512_xor_si512(_mm512_load_si512(j.xq + 64 * p), bias);
    _mm512_store_si512(xs + 64 * p, v);
    const __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), scale, v);
    _mm512_store_si512(xc + 64 * p, _mm512_sub_epi32(_mm512_setzero_si512(), c));
  }
  const GemvX x{xs, xc, reinterpret_cast<const float*>(j.xq + j.lay.d_off),
                reinterpret_cast<const float*>(j.xq + j.lay.s_off)};
  // Start the stream: the in-loop prefetches run kPrefetchBytes ahead of the first rows.
  const uint8_t* first = j.w + n0 * j.w_row_bytes;
  const int64_t lead = imin(kPrefetchBytes, (n1 - n0) * int64_t(j.w_row_bytes));
  for (int64_t off = 0; off < lead; off += 64)
    _mm_prefetch((const char*)(first + off), _MM_HINT_T0);
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR)
    gemv_rows<T, kNR>(j.w + n * j.w_row_bytes, j.w_row_bytes, dm, x, j.out + n);
  const uint8_t* w = j.w + n * j.w_row_bytes;
  switch (n1 - n) {
    case 3:
      gemv_rows<T, 3>(w, j.w_row_bytes, dm, x, j.out + n);
      break;
    case 2:
      gemv_rows<T, 2>(w, j.w_row_bytes, dm, x, j.out + n);
      break;
    case 1:
      gemv_rows<T, 1>(w, j.w_row_bytes, dm, x, j.out + n);
      break;
    default:
      break;
  }
}

// ---- M > 1: kNR weight rows packed once, reused by every kMR-row activation tile ----

struct Panel {
  __m512i* w;  // [np][kNR] signed weights
  __m512i* c;  // [np][kNR] -128 * lane sums of w (undoes the +128 of the activations)
  float* d;    // [np][kNR][2] block-pair scales
  float* m;    // [np][kNR][2] block-pair mins (Q4_1)
  Panel(uint8_t* p, const Dims& dm)
      : w(reinterpret_cast<__m512i*>(p)),
        c(w + dm.np * kNR),
        d(reinterpret_cast<float*>(c + dm.np * kNR)),
        m(d + dm.np * kNR * 2) {}
  static size_t bytes(const Dims& dm) { return size_t(dm.np) * kNR * (128 + 16); }
};

template <DType T>
void pack_panel(const uint8_t* w, size_t wrb, int nr, const Dims& dm, const Panel& pan) {
  const __m512i c128 = _mm512_set1_epi8(char(0x80));
  for (int64_t p = 0; p < dm.np; ++p) {
    const bool two = 2 * p + 1 < dm.nb;
    for (int j = 0; j < kNR; ++j) {
      __m512i wv = _mm512_setzero_si512();
      __m128 dmv = _mm_setzero_ps();  // rows past nr stay zero
      if (j < nr) {
        const uint8_t* blk = w + j * wrb + 2 * p * kBlockBytes<T>;
        if (two)
          load_pair<T, true>(blk, wv, dmv);
        else
          load_pair<T, false>(blk, wv, dmv);
        wv = to_signed<T>(wv);
      }
      const int64_t at = p * kNR + j;
      pan.w[at] = wv;
      pan.c[at] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                   _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv));
      _mm_storel_pi((__m64*)(pan.d + 2 * at), _mm_shuffle_ps(dmv, dmv, _MM_SHUFFLE(3, 1, 2, 0)));
      _mm_storel_pi((__m64*)(pan.m + 2 * at), _mm_shuffle_ps(dmv, dmv, _MM_SHUFFLE(2, 0, 3, 1)));
    }
  }
}

template <DType T, int MR, int NR>
void tile(const uint8_t* x, const Q8Layout& lay, const Dims& dm, const Panel& pan, float* out,
          int64_t ldo) {
  const int64_t np = dm.np;
  const size_t stride = lay.row_bytes, d_off = lay.d_off, s_off = lay.s_off;
  const __m512i* pw = pan.w;
  const __m512i* pc = pan.c;
  const float* pd = pan.d;
  const float* pm = pan.m;
  __m512 acc[MR][NR];
  __m256 macc[MR];  // Q4_1: lanes (2j, 2j + 1) hold the (lo, hi) min-term sums of column j
  DS_UNROLL
  for (int i = 0; i < MR; ++i) {
    macc[i] = _mm256_setzero_ps();
    DS_UNROLL
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < np; ++p) {
    __m512i xv[MR];
    __m512 dx[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) {
      const uint8_t* row = x + i * stride;
      xv[i] = _mm512_load_si512(row + 64 * p);
      dx[i] = broadcast_pair(reinterpret_cast<const float*>(row + d_off) + 2 * p);
    }
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      const __m512i w = pw[p * kNR + j], c = pc[p * kNR + j];
      const __m512 dw = broadcast_pair(pd + 2 * (p * kNR + j));
      DS_UNROLL
      for (int i = 0; i < MR; ++i)
        acc[i][j] = accumulate(acc[i][j], _mm512_dpbusd_epi32(c, xv[i], w), dw, dx[i]);
    }
    if constexpr (T == DType::Q4_1) {
      const __m256 mv = _mm256_loadu_ps(pm + 2 * p * kNR);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) {
        const auto* s = reinterpret_cast<const double*>(x + i * stride + s_off);
        macc[i] = _mm256_fmadd_ps(mv, _mm256_castpd_ps(_mm256_broadcast_sd(s + p)), macc[i]);
      }
    }
  }
  DS_UNROLL
  for (int i = 0; i < MR; ++i) {
    if constexpr (T == DType::Q4_1) {
      const __m256 t = _mm256_add_ps(macc[i], _mm256_permute_ps(macc[i], _MM_SHUFFLE(2, 3, 0, 1)));
      const __m128 lohi = _mm256_castps256_ps128(
          _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
      const __m512 z = _mm512_setzero_ps();
      const __m128 r = _mm_add_ps(
          hsum4(acc[i][0], NR > 1 ? acc[i][1] : z, NR > 2 ? acc[i][2] : z, NR > 3 ? acc[i][3] : z),
          lohi);
      _mm_mask_storeu_ps(out + i * ldo, __mmask8((1u << NR) - 1), r);
    } else {
      DS_STORE_SUMS(NR, out + i * ldo, acc[i]);
    }
  }
}

template <DType T>
using TileFn = void (*)(const uint8_t*, const Q8Layout&, const Dims&, const Panel&, float*,
                        int64_t);

template <DType T, int MR>
constexpr TileFn<T> tile_for(int nr) {
  return nr == 4   ? tile<T, MR, 4>
         : nr == 3 ? tile<T, MR, 3>
         : nr == 2 ? tile<T, MR, 2>
                   : tile<T, MR, 1>;
}

template <DType T>
TileFn<T> tile_for(int mr, int nr) {
  switch (mr) {
    case 4:
      return tile_for<T, 4>(nr);
    case 3:
      return tile_for<T, 3>(nr);
    case 2:
      return tile_for<T, 2>(nr);
    default:
      return tile_for<T, 1>(nr);
  }
}

template <DType T>
void gemm(const Q8Job& j, const Dims& dm, int64_t n0, int64_t n1, uint8_t* scratch) {
  const Panel pan(scratch, dm);
  const int64_t mb = imax(kMR, int64_t(kXBlockBytes / j.lay.row_bytes) / kMR * kMR);
  for (int64_t m0 = 0; m0 < j.M; m0 += mb) {
    const int64_t m1 = imin(j.M, m0 + mb);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int nr = int(imin(kNR, n1 - n));
      pack_panel<T>(j.w + n * j.w_row_bytes, j.w_row_bytes, nr, dm, pan);
      const TileFn<T> full = tile_for<T>(kMR, nr);
      int64_t m = m0;
      for (; m + kMR <= m1; m += kMR)
        full(j.xq + m * j.lay.row_bytes, j.lay, dm, pan, j.out + m * j.ldo + n, j.ldo);
      if (m < m1)
        tile_for<T>(int(m1 - m), nr)(j.xq + m * j.lay.row_bytes, j.lay, dm, pan,
                                     j.out + m * j.ldo + n, j.ldo);
    }
  }
}

template <DType T>
void run(const Q8Job& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  const Dims dm(j.K);
  if (j.M == 1)
    gemv<T>(j, dm, n0, n1, scratch);
  else
    gemm<T>(j, dm, n0, n1, scratch);
}

void matmul_q8(const Q8Job& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  switch (j.wtype) {
    case DType::Q4_0:
      return run<DType::Q4_0>(j, n0, n1, scratch);
    case DType::Q4_1:
      return run<DType::Q4_1>(j, n0, n1, scratch);
    default:
      return run<DType::Q8_0>(j, n0, n1, scratch);
  }
}

size_t scratch_bytes(int64_t K) {
  return Panel::bytes(Dims(K));
}

}  // namespace

const Kernels& kernels_avx512() {
  static constexpr Kernels k = {layout,    quantize_q8,         scratch_bytes,
                                matmul_q8, matmul_float_avx512, matmul_k_avx2};
  return k;
}

}  // namespace ds::cpu::detail
