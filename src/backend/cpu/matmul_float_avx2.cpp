// AVX2 kernels for F32 / F16 / BF16 weights: F32 FMA register tiles.
//
// Each output element accumulates 8-lane chunks of k in order (a zero-padded chunk for
// the tail), then hsum4: the same sequence in every tile shape.
#include "backend/cpu/float_tile_avx2.h"

namespace ds::cpu::detail {
namespace {

using ftiles::kMR;
using ftiles::kNR;
constexpr int64_t kMBlock = 64;

constexpr int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}

template <DType T>
void run(const FloatJob& j, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < j.M; m0 += kMBlock) {
    const int64_t m1 = imin(j.M, m0 + kMBlock);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int nr = int(imin(kNR, n1 - n));
      const uint8_t* w = j.w + n * j.w_row_bytes;
      for (int64_t m = m0; m < m1; m += kMR) {
        const FTileFn fn = m + 1 < m1 ? ftile_for<T, 2>(nr) : ftile_for<T, 1>(nr);
        fn(j.x + m * j.ldx, j.ldx, w, j.w_row_bytes, j.K, j.out + m * j.ldo + n, j.ldo);
      }
    }
  }
}

}  // namespace

void matmul_float_avx2(const FloatJob& j, int64_t n0, int64_t n1) {
  switch (j.wtype) {
    case DType::F32:
      return run<DType::F32>(j, n0, n1);
    case DType::F16:
      return run<DType::F16>(j, n0, n1);
    default:
      return run<DType::BF16>(j, n0, n1);
  }
}

}  // namespace ds::cpu::detail
