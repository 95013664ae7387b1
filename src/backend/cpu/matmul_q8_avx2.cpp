// AVX2 kernels for Q4_0 / Q4_1 / Q8_0 weights against 8-bit activations (vpmaddubsw).
//
// One block per ymm. Every output element runs llama.cpp's vec_dot sequence on every
// path: per block acc = fma(dw * dx, float(lanes), acc) with exact int32 lanes, hsum8,
// then + summs (Q4_1: summs = fma(m, s, summs) block by block); GEMV is the tile with one
// activation row.
#include "backend/cpu/matmul_common.h"
#include "backend/cpu/simd_avx2.h"

namespace ds::cpu::detail {
namespace {

constexpr int kMR = 2, kNR = 4;
constexpr int kPrefetchBytes = 10 << 10;
constexpr int64_t kMBlock = 256;  // activation rows per pass over a thread's weight rows

struct Dims {
  int64_t nb, nb8;  // blocks, blocks rounded up to 8
  explicit Dims(int64_t K) : nb(K / 32), nb8((K / 32 + 7) / 8 * 8) {}
};

// Row: q [nb][32] int8, d [nb8] F32, s [nb8] F32.
Q8Layout layout(int64_t K) {
  const Dims dm(K);
  Q8Layout l;
  l.nb = dm.nb;
  l.d_off = size_t(dm.nb) * 32;
  l.s_off = l.d_off + size_t(dm.nb8) * 4;
  l.row_bytes = (l.s_off + size_t(dm.nb8) * 4 + 63) / 64 * 64;
  return l;
}

void quantize_q8(const float* x, int64_t K, DType, uint8_t* row) {
  const Dims dm(K);
  const Q8Layout l = layout(K);
  auto* d = reinterpret_cast<float*>(row + l.d_off);
  auto* s = reinterpret_cast<float*>(row + l.s_off);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < dm.nb; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4), dd = mx / 127.0f;
    // 127 / amax and half-to-even rounding, as llama.cpp's quantize_row_q8_0 / q8_1.
    const __m256 id = _mm256_set1_ps(mx != 0.0f ? 127.0f / mx : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvttps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m256i p =
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered =
        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_store_si256(reinterpret_cast<__m256i*>(row + 32 * b), ordered);
    d[b] = _cvtsh_ss(_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT));
    s[b] = _cvtsh_ss(_cvtss_sh(dd * float(_mm_cvtsi128_si32(s4)), _MM_FROUND_TO_NEAREST_INT));
  }
  for (int64_t b = dm.nb; b < dm.nb8; ++b) d[b] = s[b] = 0.0f;
}

template <DType T>
constexpr int kQsOffset = T == DType::Q4_1 ? 4 : 2;

// A block's values in element order: Q4 nibbles 0..15 (unsigned) or Q8 int8.
template <DType T>
inline __m256i load_block(const uint8_t* blk) {
  const uint8_t* q = blk + kQsOffset<T>;
  if constexpr (T == DType::Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m256i both =
        _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
  }
}

// Exact int32 lanes of sum(w * x) over one block; corr = maddubs(8, x) for Q4_0.
template <DType T>
inline __m256i block_lanes(__m256i w, __m256i x, __m256i corr) {
  __m256i p;
  if constexpr (T == DType::Q8_0) {
    p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  } else {
    p = _mm256_maddubs_epi16(w, x);
    if constexpr (T == DType::Q4_0) p = _mm256_sub_epi16(p, corr);
  }
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// d of a row's blocks as F32, zero-padded to a multiple of 8; Q4_1's m into column r of
// m[nb][kNR] (the layout the min-term FMAs read).
template <DType T>
void row_scales(const uint8_t* w, const Dims& dm, int r, float* d, float* m) {
  for (int64_t b = 0; b < dm.nb; ++b) {
    const uint8_t* blk = w + b * kBlockBytes<T>;
    d[b] = _cvtsh_ss(uint16_t(blk[0] | blk[1] << 8));
    if constexpr (T == DType::Q4_1) m[b * kNR + r] = _cvtsh_ss(uint16_t(blk[2] | blk[3] << 8));
  }
  for (int64_t b = dm.nb; b < dm.nb8; ++b) d[b] = 0.0f;
}

struct Scales {
  float* d;  // [kNR][nb8]
  float* m;  // [nb][kNR]
};

template <DType T, int MR, int NR>
void tile(const uint8_t* x, const Q8Layout& lay, const Dims& dm, const uint8_t* w, size_t wrb,
          const Scales& sc, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  DS_UNROLL
  for (int i = 0; i < MR; ++i) DS_UNROLL
  for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < dm.nb; ++b) {
    __m256i xv[MR], corr[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) {
      xv[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + i * lay.row_bytes + 32 * b));
      corr[i] = T == DType::Q4_0 ? _mm256_maddubs_epi16(_mm256_set1_epi8(8), xv[i]) : xv[i];
    }
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      // GEMV streams the weights from DRAM: fetch ahead of the hardware prefetcher.
      if constexpr (MR == 1)
        _mm_prefetch((const char*)(w + j * wrb + b * kBlockBytes<T> + kPrefetchBytes), _MM_HINT_T0);
      const __m256i wv = load_block<T>(w + j * wrb + b * kBlockBytes<T>);
      const __m256 dw = _mm256_broadcast_ss(sc.d + j * dm.nb8 + b);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) {
        const float* xd = reinterpret_cast<const float*>(x + i * lay.row_bytes + lay.d_off);
        const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + b));
        acc[i][j] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(block_lanes<T>(wv, xv[i], corr[i])),
                                    acc[i][j]);
      }
    }
  }
  DS_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m256 z = _mm256_setzero_ps();
    __m128 r =
        hsum4(acc[i][0], NR > 1 ? acc[i][1] : z, NR > 2 ? acc[i][2] : z, NR > 3 ? acc[i][3] : z);
    if constexpr (T == DType::Q4_1) {
      // summs for the NR columns in lanes, one block after another as llama.cpp adds them.
      const auto* s = reinterpret_cast<const float*>(x + i * lay.row_bytes + lay.s_off);
      __m128 summs = _mm_setzero_ps();
      for (int64_t b = 0; b < dm.nb; ++b)
        summs = _mm_fmadd_ps(_mm_loadu_ps(sc.m + b * kNR), _mm_broadcast_ss(s + b), summs);
      r = _mm_add_ps(r, summs);
    }
    alignas(16) float tmp[4];
    _mm_store_ps(tmp, r);
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = tmp[j];
  }
}

template <DType T>
using TileFn = void (*)(const uint8_t*, const Q8Layout&, const Dims&, const uint8_t*, size_t,
                        const Scales&, float*, int64_t);

template <DType T, int MR>
constexpr TileFn<T> tile_for(int nr) {
  return nr == 4   ? tile<T, MR, 4>
         : nr == 3 ? tile<T, MR, 3>
         : nr == 2 ? tile<T, MR, 2>
                   : tile<T, MR, 1>;
}

template <DType T>
void run(const Q8Job& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  const Dims dm(j.K);
  const Scales sc{reinterpret_cast<float*>(scratch),
                  reinterpret_cast<float*>(scratch) + kNR * dm.nb8};
  if constexpr (T == DType::Q4_1)
    for (int64_t i = 0; i < kNR * dm.nb; ++i) sc.m[i] = 0.0f;  // columns past nr stay 0
  for (int64_t m0 = 0; m0 < j.M; m0 += kMBlock) {
    const int64_t m1 = imin(j.M, m0 + kMBlock);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int nr = int(imin(kNR, n1 - n));
      const uint8_t* w = j.w + n * j.w_row_bytes;
      for (int r = 0; r < nr; ++r)
        row_scales<T>(w + r * j.w_row_bytes, dm, r, sc.d + r * dm.nb8, sc.m);
      for (int64_t m = m0; m < m1; m += kMR) {
        const TileFn<T> fn = m + 1 < m1 ? tile_for<T, 2>(nr) : tile_for<T, 1>(nr);
        fn(j.xq + m * j.lay.row_bytes, j.lay, dm, w, j.w_row_bytes, sc, j.out + m * j.ldo + n,
           j.ldo);
      }
    }
  }
}

void matmul_q8(const Q8Job& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  with_type<DType::Q4_0, DType::Q4_1, DType::Q8_0>(
      j.wtype, [&](auto t) { run<decltype(t)::value>(j, n0, n1, scratch); });
}

size_t scratch_bytes(int64_t K) {
  return size_t(2 * kNR) * size_t(Dims(K).nb8) * 4;
}

}  // namespace

const Kernels& kernels_avx2() {
  static constexpr Kernels k = {layout,
                                quantize_q8,
                                scratch_bytes,
                                matmul_q8,
                                matmul_float_avx2,
                                matmul_k_avx2,
                                precise_scratch_bytes_avx2,
                                matmul_precise_avx2};
  return k;
}

}  // namespace ds::cpu::detail
