// AVX-512 VNNI kernels for Q4_0 / Q4_1 / Q8_0 weights against 8-bit activations.
//
// Two blocks share one zmm: dword lane 2u+b holds elements 4u..4u+3 of block b of the
// pair, so a vpdpbusd leaves per-block partial sums in alternating lanes and the two block
// scales broadcast as one 64-bit pair. Activations are stored as q + 128 (unsigned).
//
// Every output element runs the same float sequence on every path: for each block pair p
//   acc = fma(float(lanes_p), dw_p * dx_p, acc)
// where lanes_p are exact int32 sums sum(x_q * w_q) over the lane's four elements, then
// Q4_1 adds its min term, then hsum4. GEMV (M == 1) and the register tiles differ only in
// how they form the exact integer lanes, so batched results equal single-row ones.
#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/simd_avx512.h"

namespace ds::cpu::detail {
namespace {

constexpr int kMR = 4, kNR = 4;

// Local helpers instead of std::min/max: no library template gets instantiated with
// AVX-512 flags and then merged by the linker into code that runs on other CPUs.
constexpr int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
constexpr int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
template <bool V>
struct Bool {
  static constexpr bool value = V;
};
constexpr size_t kXBlockBytes = 256 << 10;  // activation rows kept hot in L2 per pass

struct Dims {
  int64_t nb, np, nb16;  // blocks, block pairs, blocks rounded up to 16
  explicit Dims(int64_t K) : nb(K / 32), np((K / 32 + 1) / 2), nb16((K / 32 + 15) / 16 * 16) {}
};

Q8Layout layout(int64_t K) {
  const Dims dm(K);
  Q8Layout l;
  l.nb = dm.nb;
  l.d_off = size_t(dm.np) * 64;
  l.s_off = (l.d_off + size_t(dm.np) * 8 + 63) / 64 * 64;
  l.row_bytes = (l.s_off + size_t(dm.nb16) * 4 + 63) / 64 * 64;
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
        d[blk] = 0.0f;
      }
    }
    const __m512i z = _mm512_permutex2var_epi32(_mm512_castsi256_si512(q[0]), idx,
                                                _mm512_castsi256_si512(q[1]));
    _mm512_store_si512(row + 64 * p, _mm512_xor_si512(z, bias));
  }
  for (int64_t b = dm.nb; b < dm.nb16; ++b) s[b] = 0.0f;
}

// ---- weights ----

template <DType T>
constexpr int kBlockBytes = T == DType::Q4_0 ? 18 : T == DType::Q4_1 ? 20 : 34;
template <DType T>
constexpr int kQsOffset = T == DType::Q4_1 ? 4 : 2;

// Raw values of blocks (blk, blk + 1) in pair lane order: Q4 nibbles 0..15 or Q8 int8.
// kTwo = false for a row's odd last block (the second half is zero).
template <DType T, bool kTwo>
inline __m512i load_pair(const uint8_t* blk) {
  const uint8_t* q0 = blk + kQsOffset<T>;
  const uint8_t* q1 = q0 + kBlockBytes<T>;
  if constexpr (T == DType::Q8_0) {
    const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)q0));
    const __m512i b = kTwo ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)q1))
                           : _mm512_setzero_si512();
    return _mm512_permutex2var_epi32(a, pair_index(), b);
  } else {
    const __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)q0));
    const __m512i b =
        kTwo ? _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)q1)) : _mm512_setzero_si512();
    // Both 256-bit halves [a0 b0 a1 b1 a2 b2 a3 b3]; the upper half keeps the high nibbles.
    const __m512i idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 0, 16, 1, 17, 2, 18, 3, 19);
    const __m512i t = _mm512_permutex2var_epi32(a, idx, b);
    const __m512i sh = _mm512_mask_srli_epi16(t, __mmask32(0xffff0000u), t, 4);
    return _mm512_and_si512(sh, _mm512_set1_epi8(0x0f));
  }
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

// d (and Q4_1's m) of a row's blocks as F32, zero-padded to a multiple of 16. Scalar
// loads: a gather here is slower when the weights stream from DRAM (TLB misses).
template <DType T>
void row_scales(const uint8_t* w, int64_t nb, float* d, float* m) {
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    alignas(32) uint16_t dh[16] = {}, mh[16] = {};
    const int64_t n = imin(16, nb - b0);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* blk = w + (b0 + i) * kBlockBytes<T>;
      __builtin_memcpy(&dh[i], blk, 2);
      if constexpr (T == DType::Q4_1) __builtin_memcpy(&mh[i], blk + 2, 2);
    }
    _mm512_storeu_ps(d + b0, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)dh)));
    if constexpr (T == DType::Q4_1)
      _mm512_storeu_ps(m + b0, _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)mh)));
  }
}

inline void accumulate(__m512& acc, __m512i lanes, __m512 dw, __m512 dx) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(dw, dx), acc);
}

// Q4_1: sum over blocks of m_w * s_x, added lane-wise before the final sum.
inline void add_min_term(__m512& acc, const float* m, const float* s, int64_t nb16) {
  __m512 macc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb16; b += 16)
    macc = _mm512_fmadd_ps(_mm512_loadu_ps(m + b), _mm512_loadu_ps(s + b), macc);
  acc = _mm512_add_ps(acc, macc);
}

// ---- M == 1: stream NR weight rows against one activation row ----

struct GemvX {
  const uint8_t* xs;  // [np, 64] signed q
  const uint8_t* xc;  // [np, 64] int32 lane corrections (Q4_0: -8 sum x, Q8_0: -128 sum x)
  const float* d;     // [np * 2]
  const float* s;     // [nb16]
};

template <DType T, int NR>
void gemv_rows(const uint8_t* w, size_t wrb, const Dims& dm, const GemvX& x, float* wd, float* wm,
               float* out) {
  for (int j = 0; j < NR; ++j) row_scales<T>(w + j * wrb, dm.nb, wd + j * dm.nb16, wm + j * dm.nb16);
  __m512 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  const int64_t full = dm.nb / 2;
  auto step = [&](int64_t p, auto two) {
    const __m512i xv = _mm512_load_si512(x.xs + 64 * p);
    const __m512 dx = broadcast_pair(x.d + 2 * p);
    const __m512i c =
        T == DType::Q4_1 ? _mm512_setzero_si512() : _mm512_load_si512(x.xc + 64 * p);
    for (int j = 0; j < NR; ++j) {
      const uint8_t* blk = w + j * wrb + 2 * p * kBlockBytes<T>;
      const __m512i wu = to_unsigned<T>(load_pair<T, decltype(two)::value>(blk));
      accumulate(acc[j], _mm512_dpbusd_epi32(c, wu, xv), broadcast_pair(wd + j * dm.nb16 + 2 * p),
                 dx);
    }
  };
  for (int64_t p = 0; p < full; ++p) step(p, Bool<true>{});
  if (full < dm.np) step(full, Bool<false>{});
  if constexpr (T == DType::Q4_1)
    for (int j = 0; j < NR; ++j) add_min_term(acc[j], wm + j * dm.nb16, x.s, dm.nb16);
  store_sums<NR>(acc, out);
}

template <DType T>
void gemv(const Q8Job& j, const Dims& dm, int64_t n0, int64_t n1, uint8_t* scratch) {
  auto* xs = scratch;
  auto* xc = xs + dm.np * 64;
  auto* wd = reinterpret_cast<float*>(xc + dm.np * 64);
  float* wm = wd + kNR * dm.nb16;
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
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR)
    gemv_rows<T, kNR>(j.w + n * j.w_row_bytes, j.w_row_bytes, dm, x, wd, wm, j.out + n);
  const uint8_t* w = j.w + n * j.w_row_bytes;
  switch (n1 - n) {
    case 3: gemv_rows<T, 3>(w, j.w_row_bytes, dm, x, wd, wm, j.out + n); break;
    case 2: gemv_rows<T, 2>(w, j.w_row_bytes, dm, x, wd, wm, j.out + n); break;
    case 1: gemv_rows<T, 1>(w, j.w_row_bytes, dm, x, wd, wm, j.out + n); break;
    default: break;
  }
}

// ---- M > 1: kNR weight rows packed once, reused by every kMR-row activation tile ----

struct Panel {
  __m512i* w;  // [np][kNR] signed weights
  __m512i* c;  // [np][kNR] -128 * lane sums of w (undoes the +128 of the activations)
  float* d;    // [kNR][nb16]
  float* m;    // [kNR][nb16]
  Panel(uint8_t* p, const Dims& dm)
      : w(reinterpret_cast<__m512i*>(p)),
        c(w + dm.np * kNR),
        d(reinterpret_cast<float*>(c + dm.np * kNR)),
        m(d + kNR * dm.nb16) {}
  static size_t bytes(const Dims& dm) {
    return size_t(dm.np) * kNR * 128 + size_t(kNR) * dm.nb16 * 8;
  }
};

template <DType T>
void pack_panel(const uint8_t* w, size_t wrb, int nr, const Dims& dm, const Panel& pan) {
  const __m512i c128 = _mm512_set1_epi8(char(0x80));
  for (int j = 0; j < nr; ++j) {
    const uint8_t* row = w + j * wrb;
    row_scales<T>(row, dm.nb, pan.d + j * dm.nb16, pan.m + j * dm.nb16);
    for (int64_t p = 0; p < dm.np; ++p) {
      const uint8_t* blk = row + 2 * p * kBlockBytes<T>;
      const __m512i ws = to_signed<T>(2 * p + 1 < dm.nb ? load_pair<T, true>(blk)
                                                        : load_pair<T, false>(blk));
      pan.w[p * kNR + j] = ws;
      pan.c[p * kNR + j] = _mm512_sub_epi32(
          _mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, ws));
    }
  }
}

template <DType T, int MR, int NR>
void tile(const uint8_t* x, const Q8Layout& lay, const Dims& dm, const Panel& pan, float* out,
          int64_t ldo) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dm.np; ++p) {
    __m512i xv[MR];
    __m512 dx[MR];
    for (int i = 0; i < MR; ++i) {
      const uint8_t* row = x + i * lay.row_bytes;
      xv[i] = _mm512_load_si512(row + 64 * p);
      dx[i] = broadcast_pair(reinterpret_cast<const float*>(row + lay.d_off) + 2 * p);
    }
    for (int j = 0; j < NR; ++j) {
      const __m512i w = pan.w[p * kNR + j], c = pan.c[p * kNR + j];
      const __m512 dw = broadcast_pair(pan.d + j * dm.nb16 + 2 * p);
      for (int i = 0; i < MR; ++i) accumulate(acc[i][j], _mm512_dpbusd_epi32(c, xv[i], w), dw, dx[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (T == DType::Q4_1) {
      const auto* s = reinterpret_cast<const float*>(x + i * lay.row_bytes + lay.s_off);
      for (int j = 0; j < NR; ++j) add_min_term(acc[i][j], pan.m + j * dm.nb16, s, dm.nb16);
    }
    store_sums<NR>(acc[i], out + i * ldo);
  }
}

template <DType T>
using TileFn = void (*)(const uint8_t*, const Q8Layout&, const Dims&, const Panel&, float*, int64_t);

template <DType T, int MR>
constexpr TileFn<T> tile_for(int nr) {
  return nr == 4 ? tile<T, MR, 4> : nr == 3 ? tile<T, MR, 3> : nr == 2 ? tile<T, MR, 2> : tile<T, MR, 1>;
}

template <DType T>
TileFn<T> tile_for(int mr, int nr) {
  switch (mr) {
    case 4: return tile_for<T, 4>(nr);
    case 3: return tile_for<T, 3>(nr);
    case 2: return tile_for<T, 2>(nr);
    default: return tile_for<T, 1>(nr);
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
    case DType::Q4_0: return run<DType::Q4_0>(j, n0, n1, scratch);
    case DType::Q4_1: return run<DType::Q4_1>(j, n0, n1, scratch);
    default: return run<DType::Q8_0>(j, n0, n1, scratch);
  }
}

size_t scratch_bytes(int64_t K) { return Panel::bytes(Dims(K)); }

}  // namespace

const Kernels& kernels_avx512() {
  static constexpr Kernels k = {kNR,        layout,       quantize_q8, scratch_bytes,
                                matmul_q8,  matmul_float_avx512, matmul_k_avx2};
  return k;
}

}  // namespace ds::cpu::detail
