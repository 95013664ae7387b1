// The precise kernels (block-quantized weights against F32 activations) written once for
// every ISA: Isa (PreciseIsa in matmul_precise_<isa>.cpp) supplies the vector type, the
// dequantization of a block and the horizontal sums; this header holds the loops.
// Include only from those files (after their float_tile_<isa>.h).
//
// Every weight is dequantized to the same F32 value on every path:
//   Q4_0 d * (q - 8)   Q4_1 fma(d, q, m)   Q5_0 d * (q - 16)   Q5_1 fma(d, q, m)   Q8_0 d * q
//   Q4_K, Q5_K fma(d * sc, q, -(dmin * mn))                    Q6_K (d * sc) * (q - 32)
// GEMV (M == 1) decodes the weights in registers as they stream from DRAM; GEMM
// dequantizes a panel of weight rows once into an L1-resident buffer and runs the float
// tiles on it. Every output element accumulates fma(x, w, acc) over Isa::kW-lane chunks of
// k in order, then hsum4, on both paths: both give the same bits.
#pragma once

#include "backend/cpu/float_tile.h"

namespace ds::cpu::detail {
namespace {

// One F16 value at p (F16C, which every kernel ISA has).
inline float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

namespace precise {

constexpr int kPrefetchBytes = 10 << 10;  // GEMV software prefetch distance
constexpr int64_t kMBlock = 64;           // GEMM activation rows per pass over a panel
constexpr int kChunk = 16;                // GEMV blocks whose scales are converted at once

// Types the GEMV decodes straight into registers; the others go through an L1 buffer.
template <DType T>
constexpr bool kDirect = T == DType::Q4_0 || T == DType::Q4_1 || T == DType::Q8_0;

// One block of type T to kBlockElems<T> floats.
template <class Isa, DType T>
void dequant_block(const uint8_t* blk, float* out) {
  if constexpr (kDirect<T>) {
    constexpr int kV = 32 / Isa::kW;
    typename Isa::V w[kV];
    Isa::template decode<T>(blk, h2f(blk), T == DType::Q4_1 ? h2f(blk + 2) : 0.0f, w);
    for (int c = 0; c < kV; ++c) Isa::storeu(out + Isa::kW * c, w[c]);
  } else if constexpr (T == DType::Q5_0 || T == DType::Q5_1) {
    Isa::template dequant_q5<T>(blk, out);
  } else if constexpr (T == DType::Q4_K) {
    Isa::dequant_q4_k(*reinterpret_cast<const BlockQ4_K*>(blk), out);
  } else if constexpr (T == DType::Q5_K) {
    Isa::dequant_q5_k(*reinterpret_cast<const BlockQ5_K*>(blk), out);
  } else {
    Isa::dequant_q6_k(*reinterpret_cast<const BlockQ6_K*>(blk), out);
  }
}

// Q4_0 / Q4_1 / Q8_0: Isa::kRows rows decoded in registers. Their block scales (and mins)
// are first copied kChunk blocks at a time and converted a vector of halves at once.
template <class Isa, DType T>
void gemv_rows_small(const uint8_t* const* rows, int nr, const float* x, int64_t nb, float* out,
                     uint8_t* scratch) {
  using V = typename Isa::V;
  constexpr int kRows = Isa::kRows, kV = 32 / Isa::kW;                // kV: vectors per block
  auto* half = reinterpret_cast<uint32_t*>(scratch);                  // [kChunk][kRows] halves
  auto* dm = reinterpret_cast<float*>(scratch + kChunk * kRows * 4);  // [kChunk][kRows][2]
  V acc[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) acc[r] = Isa::zero();
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
    const int nc = int(imin(kChunk, nb - c0));
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < kRows; ++r) {
        uint32_t h;
        __builtin_memcpy(&h, rows[r] + (c0 + c) * kBlockBytes<T>, 4);
        half[c * kRows + r] = T == DType::Q4_1 ? h : (h & 0xffff);
      }
    Isa::halves_to_floats(half, nc * kRows * 2, dm);
    for (int c = 0; c < nc; ++c) {
      const int64_t b = c0 + c;
      V xv[kV];
      for (int k = 0; k < kV; ++k) xv[k] = Isa::loadu(x + 32 * b + Isa::kW * k);
      DS_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* blk = rows[r] + b * kBlockBytes<T>;
        if (T == DType::Q8_0 || (b & 1) == 0)  // once per 64 bytes of each row
          _mm_prefetch((const char*)(blk + kPrefetchBytes), _MM_HINT_T0);
        V w[kV];
        Isa::template decode<T>(blk, dm[(c * kRows + r) * 2], dm[(c * kRows + r) * 2 + 1], w);
        for (int k = 0; k < kV; ++k) acc[r] = Isa::fma(xv[k], w[k], acc[r]);
      }
    }
  }
  Isa::store_rows(acc, nr, out);
}

// The other types: each block of Isa::kRows rows dequantized into an L1 buffer, then the
// FMAs.
template <class Isa, DType T>
void gemv_rows_buffered(const uint8_t* const* rows, int nr, const float* x, int64_t nb, float* out,
                        uint8_t* scratch) {
  using V = typename Isa::V;
  constexpr int kE = kBlockElems<T>, kRows = Isa::kRows;
  auto* buf = reinterpret_cast<float*>(scratch);  // [kRows][kE]
  V acc[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) acc[r] = Isa::zero();
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* blk = rows[r] + b * kBlockBytes<T>;
      for (int off = 0; off < kBlockBytes<T>; off += 64)
        _mm_prefetch((const char*)(blk + kPrefetchBytes + off), _MM_HINT_T0);
      dequant_block<Isa, T>(blk, buf + r * kE);
    }
    for (int k = 0; k < kE; k += Isa::kW) {
      const V xv = Isa::loadu(x + b * kE + k);
      DS_UNROLL
      for (int r = 0; r < kRows; ++r) acc[r] = Isa::fma(xv, Isa::load(buf + r * kE + k), acc[r]);
    }
  }
  Isa::store_rows(acc, nr, out);
}

template <class Isa, DType T>
void gemv(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  constexpr int kRows = Isa::kRows;
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
      gemv_rows_small<Isa, T>(rows, nr, j.x, nb, j.out + n, scratch);
    else
      gemv_rows_buffered<Isa, T>(rows, nr, j.x, nb, j.out + n, scratch);
  }
}

// M > 1: panels of dequantized rows under the float tiles.
template <class Isa, DType T>
void gemm(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  using Tile = typename Isa::Tile;
  auto* panel = reinterpret_cast<float*>(scratch);  // [Tile::kNR][K]
  const int64_t nb = j.K / kBlockElems<T>;
  const size_t panel_row = size_t(j.K) * 4;
  for (int64_t m0 = 0; m0 < j.M; m0 += kMBlock) {
    const int64_t m1 = imin(j.M, m0 + kMBlock);
    for (int64_t n = n0; n < n1; n += Tile::kNR) {
      const int nr = int(imin(Tile::kNR, n1 - n));
      for (int r = 0; r < nr; ++r) {
        const uint8_t* row = j.w + (n + r) * j.w_row_bytes;
        for (int64_t b = 0; b < nb; ++b)
          dequant_block<Isa, T>(row + b * kBlockBytes<T>, panel + r * j.K + b * kBlockElems<T>);
      }
      const auto* w = reinterpret_cast<const uint8_t*>(panel);
      for (int64_t m = m0; m < m1; m += Tile::kMR)
        ftile_for<Tile, DType::F32>(int(imin(Tile::kMR, m1 - m)), nr)(
            j.x + m * j.ldx, j.ldx, w, panel_row, j.K, j.out + m * j.ldo + n, j.ldo);
    }
  }
}

template <class Isa>
size_t scratch_bytes(int64_t K) {
  // GEMV: kRows buffered blocks of up to 256 floats (more than the small path's scales).
  const size_t gemv = size_t(Isa::kRows) * 256 * 4 + 64;
  const size_t panel = size_t(Isa::Tile::kNR) * size_t(K) * 4;
  return panel > gemv ? panel : gemv;
}

template <class Isa>
void matmul(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  with_type<DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q5_0, DType::Q5_1, DType::Q4_K,
            DType::Q5_K, DType::Q6_K>(j.wtype, [&](auto t) {
    constexpr DType T = decltype(t)::value;
    if (j.M == 1)
      gemv<Isa, T>(j, n0, n1, scratch);
    else
      gemm<Isa, T>(j, n0, n1, scratch);
  });
}

}  // namespace precise
}  // namespace
}  // namespace ds::cpu::detail
