// F32 FMA register tiles over F32 / F16 / BF16 weight rows, written once for every ISA:
// Isa (TileIsa in float_tile_<isa>.h) supplies the vector type, its loads, FMA and
// horizontal-sum store. Used by the float-weight kernels and by the precise quantized
// kernels (which run the tiles on dequantized panels). Include only through
// float_tile_<isa>.h: everything here has internal linkage.
//
// Each output element accumulates Isa::kW-lane chunks of k in order (a zero-padded chunk
// for the tail), then hsum4: the same sequence in every tile shape, so results do not
// depend on M.
#pragma once

#include "backend/cpu/matmul_common.h"
#include "backend/cpu/simd_common.h"

namespace ds::cpu::detail {
namespace {

template <class Isa, DType T, int MR, int NR>
void ftile(const float* x, int64_t ldx, const uint8_t* w, size_t wrb, int64_t K, float* out,
           int64_t ldo) {
  using V = typename Isa::V;
  constexpr int kW = Isa::kW;
  V acc[MR][NR];
  DS_UNROLL
  for (int i = 0; i < MR; ++i) DS_UNROLL
  for (int j = 0; j < NR; ++j) acc[i][j] = Isa::zero();
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    V xv[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) xv[i] = Isa::loadu(x + i * ldx + k);
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      const V wv = Isa::template load_w<T>(w + j * wrb, k);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) acc[i][j] = Isa::fma(xv[i], wv, acc[i][j]);
    }
  }
  if (k < K) {
    const auto mask = Isa::tail_mask(K - k);
    V xv[MR];
    DS_UNROLL
    for (int i = 0; i < MR; ++i) xv[i] = Isa::load_tail(x + i * ldx + k, mask);
    DS_UNROLL
    for (int j = 0; j < NR; ++j) {
      const V wv = Isa::template load_w_tail<T>(w + j * wrb, k, K - k, mask);
      DS_UNROLL
      for (int i = 0; i < MR; ++i) acc[i][j] = Isa::fma(xv[i], wv, acc[i][j]);
    }
  }
  DS_UNROLL
  for (int i = 0; i < MR; ++i) Isa::template store_row<NR>(acc[i], out + i * ldo);
}

using FTileFn = void (*)(const float*, int64_t, const uint8_t*, size_t, int64_t, float*, int64_t);

template <class Isa, DType T, int MR>
constexpr FTileFn ftile_nr(int nr) {
  return nr == 4   ? ftile<Isa, T, MR, 4>
         : nr == 3 ? ftile<Isa, T, MR, 3>
         : nr == 2 ? ftile<Isa, T, MR, 2>
                   : ftile<Isa, T, MR, 1>;
}

// The tile for mr (1..Isa::kMR) activation rows and nr (1..Isa::kNR) weight rows.
template <class Isa, DType T>
FTileFn ftile_for(int mr, int nr) {
  static_assert(Isa::kNR == 4 && (Isa::kMR == 2 || Isa::kMR == 4));
  if constexpr (Isa::kMR == 4) {
    if (mr >= 4) return ftile_nr<Isa, T, 4>(nr);
    if (mr == 3) return ftile_nr<Isa, T, 3>(nr);
  }
  return mr >= 2 ? ftile_nr<Isa, T, 2>(nr) : ftile_nr<Isa, T, 1>(nr);
}

// out[0..M, n0..n1) for float weights, tile by tile.
template <class Isa, DType T>
void float_run(const FloatJob& j, int64_t n0, int64_t n1) {
  constexpr int64_t kMBlock = 64;  // activation rows per pass over a thread's weight rows
  for (int64_t m0 = 0; m0 < j.M; m0 += kMBlock) {
    const int64_t m1 = imin(j.M, m0 + kMBlock);
    for (int64_t n = n0; n < n1; n += Isa::kNR) {
      const int nr = int(imin(Isa::kNR, n1 - n));
      const uint8_t* w = j.w + n * j.w_row_bytes;
      for (int64_t m = m0; m < m1; m += Isa::kMR)
        ftile_for<Isa, T>(int(imin(Isa::kMR, m1 - m)), nr)(j.x + m * j.ldx, j.ldx, w, j.w_row_bytes,
                                                           j.K, j.out + m * j.ldo + n, j.ldo);
    }
  }
}

template <class Isa>
void matmul_float(const FloatJob& j, int64_t n0, int64_t n1) {
  with_type<DType::F32, DType::F16, DType::BF16>(
      j.wtype, [&](auto t) { float_run<Isa, decltype(t)::value>(j, n0, n1); });
}

}  // namespace
}  // namespace ds::cpu::detail
