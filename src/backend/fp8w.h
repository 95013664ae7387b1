// FP8 weights (--quantize fp8, and FP8 checkpoints): e4m3 codes with one F32 scale per row and
// group of 128 along K. Host and device code share these functions (included by .cu files), so
// a weight quantized on the GPU has the same bits as one made on the CPU.
//
// Layout of a [N, K] FP8W tensor (any K >= 1): row n starts at n * row_stride(K) bytes and holds
// K e4m3 codes (byte k = element k), zero bytes up to code_bytes(K) (a multiple of 16), then
// groups(K) F32 scales, then zero padding up to row_stride(K).
// Element k of row n = e4m3(code) * scale[k / 128].
//
// Scales are per row and 128-group ("1 x 128"): quantizing at load computes them that way (finer
// than DeepSeek-V3's 128 x 128 blocks for the same bytes), and a checkpoint's 128 x 128 block
// scale (`weight_scale_inv`) is copied into each of its 128 rows; a per-channel scale into each
// group of its row. The scales cost 4 bytes per 128 weights (3%).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DS_F8_HD __host__ __device__ inline
#else
#include <cmath>
#define DS_F8_HD inline
#endif

namespace ds::fp8w {

constexpr int kGroup = 128;
constexpr float kMax = 448.0f;  // the largest finite e4m3 value (code 0x7e)

DS_F8_HD int64_t code_bytes(int64_t k) {
  return (k + 15) / 16 * 16;
}
DS_F8_HD int64_t groups(int64_t k) {
  return (k + kGroup - 1) / kGroup;
}
// Bytes between rows (host code; random_fill.cpp): the codes and scales on whole 128-byte L2
// lines where that adds at most 1/16 of the row, else padded to 16 bytes (w4a16.h's rule: W1f
// +2.3% on the H100). DEEPSERVE_FP8W_ROW_ALIGN=N (16 .. 256, a power of two) pads every row to
// N, for A/Bs.
int64_t row_stride(int64_t k);

// e4m3 (bias 7, no infinities, 0x7f / 0xff NaN) to float, exactly.
DS_F8_HD float decode(uint8_t v) {
  const int e = (v >> 3) & 15, m = v & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e == 0 ? ldexpf(float(m), -9) : ldexpf(float(8 + m), e - 10);
  return (v & 0x80) ? -mag : mag;
}

// float to e4m3, rounded to nearest even, saturated to +-448 (NaN to 0x7f). The codes of
// non-negative values are monotonic (code = exponent field * 8 + mantissa), so the rounded
// multiple of the value's step maps to the code directly and a carry moves to the next binade.
DS_F8_HD uint8_t encode(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  const uint8_t sign = uint8_t((b >> 24) & 0x80);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7f;
  const float a = fabsf(f);
  if (!(a < kMax)) return uint8_t(sign | 0x7e);
  const int e = int((b >> 23) & 0xff) - 127;  // a's binade (a >= 2^-6: a normal e4m3 range)
  int code;
  if (e < -6) {
    code = int(rintf(ldexpf(a, 9)));  // subnormal steps of 2^-9; 8 is the smallest normal
  } else {
    const int r = int(rintf(ldexpf(a, 3 - e)));  // in [8, 16]
    code = (e + 7) * 8 + (r - 8);
  }
  if (code > 0x7e) code = 0x7e;
  return uint8_t(sign | code);
}

// Scale g of a row of K elements.
DS_F8_HD float scale(const uint8_t* row, int64_t K, int64_t g) {
  float s;
  memcpy(&s, row + code_bytes(K) + g * 4, 4);
  return s;
}
DS_F8_HD void set_scale(uint8_t* row, int64_t K, int64_t g, float s) {
  memcpy(row + code_bytes(K) + g * 4, &s, 4);
}

// Element k of an FP8W row.
DS_F8_HD float element(const uint8_t* row, int64_t K, int64_t k) {
  return decode(row[k]) * scale(row, K, k / kGroup);
}

// Quantizes one row of K floats into row_stride(K) bytes: scale = absmax / 448 per group (1 for
// an all-zero group), code = e4m3(x / scale). Host code (the GPU's copy is in fill_random.cu).
inline void quantize_row(const float* x, int64_t K, uint8_t* dst) {
  memset(dst, 0, size_t(row_stride(K)));
  for (int64_t g = 0; g < groups(K); ++g) {
    const int64_t k0 = g * kGroup, k1 = k0 + kGroup < K ? k0 + kGroup : K;
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; ++k) amax = fmaxf(amax, fabsf(x[k]));
    const float s = amax > 0.0f ? amax / kMax : 1.0f;
    set_scale(dst, K, g, s);
    for (int64_t k = k0; k < k1; ++k) dst[k] = encode(x[k] / s);
  }
}

}  // namespace ds::fp8w
