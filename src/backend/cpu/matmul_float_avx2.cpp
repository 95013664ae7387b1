// AVX2 kernels for F32 / F16 / BF16 weights: the float tiles (float_tile.h) on 8 lanes.
#include "backend/cpu/float_tile_avx2.h"

namespace ds::cpu::detail {

void matmul_float_avx2(const FloatJob& j, int64_t n0, int64_t n1) {
  matmul_float<TileIsa>(j, n0, n1);
}

}  // namespace ds::cpu::detail
