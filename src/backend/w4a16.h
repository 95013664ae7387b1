// W4A16 weights (--quantize w4a16): symmetric 4-bit integers, one BF16 scale per output row
// and group of 128 along K, activations kept in 16/32-bit floats. Also the deterministic
// generator of dummy weights (--load-format dummy). Host and device code share these
// functions (included by .cu files), so a weight quantized or generated on the GPU has the
// same bits as one made on the CPU.
//
// Layout of a [N, K] W4A16 tensor (K a multiple of 128): row n starts at n * row_stride(K)
// bytes and holds K / 2 bytes of codes (byte j: element 2j in the low nibble, 2j + 1 in the
// high one; a code c stands for c - 8), then K / 128 BF16 scales, then zero padding up to
// row_stride(K), so every row can be streamed with 16-byte loads.
// Element k of row n = (code - 8) * scale[k / 128].
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DS_W4_HD __host__ __device__ inline
#else
#include <cmath>
#define DS_W4_HD inline
#endif
#include <cstring>

namespace ds::w4a16 {

constexpr int kGroup = 128;  // elements per scale
constexpr int kMaxCode = 7;  // symmetric: scale = absmax / 7, codes clamp to [-8, 7]

DS_W4_HD int64_t code_bytes(int64_t k) {
  return k / 2;
}
// Bytes between rows (host code; random_fill.cpp): the codes and scales padded to 16 bytes, so
// every row can be streamed with 16-byte loads, or to a whole number of 128-byte L2 lines where
// that adds at most 1/16 of the row: then a stage's 128-byte chunk of each row never straddles
// two lines. DEEPSERVE_W4A16_ROW_ALIGN=N (16 .. 256, a power of two) pads every row to N.
int64_t row_stride(int64_t k);

// The bits of a value as another type of the same size (memcpy: fine in device code too).
template <typename To, typename From>
DS_W4_HD To bit_as(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_as: sizes differ");
  To t;
  memcpy(&t, &v, sizeof t);
  return t;
}
DS_W4_HD uint32_t float_bits(float f) {
  return bit_as<uint32_t>(f);
}
DS_W4_HD float bits_float(uint32_t u) {
  return bit_as<float>(u);
}
// Round to nearest even BF16 (finite inputs), as bits, and back.
DS_W4_HD uint16_t to_bf16(float f) {
  uint32_t b = float_bits(f);
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}
DS_W4_HD float from_bf16(uint16_t h) {
  return bits_float(uint32_t(h) << 16);
}
// Correctly rounded multiply and divide on both sides (no FMA contraction on the device).
DS_W4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DS_W4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Quantizes one group of 128 values: codes into 64 bytes, the scale as BF16 bits.
DS_W4_HD void quantize_group(const float* x, uint8_t* codes, uint16_t* scale) {
  float amax = 0.0f;
  for (int i = 0; i < kGroup; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const uint16_t s16 = to_bf16(amax / float(kMaxCode));
  const float s = from_bf16(s16);
  *scale = s16;
  for (int i = 0; i < kGroup; i += 2) {
    int q[2];
    for (int j = 0; j < 2; ++j) {
      const float r = s > 0.0f ? rintf(x[i + j] / s) : 0.0f;
      q[j] = int(fminf(fmaxf(r, -8.0f), 7.0f)) + 8;
    }
    codes[i / 2] = uint8_t(q[0] | (q[1] << 4));
  }
}

// Element k of a W4A16 row.
DS_W4_HD float element(const uint8_t* row, int64_t K, int64_t k) {
  const uint8_t b = row[k / 2];
  const int code = (k & 1) ? (b >> 4) : (b & 15);
  uint16_t s;
  s = uint16_t(row[K / 2 + (k / kGroup) * 2] | (row[K / 2 + (k / kGroup) * 2 + 1] << 8));
  return mul_rn(float(code - 8), from_bf16(s));
}

// ---- dummy weights ------------------------------------------------------------------------
DS_W4_HD uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// A roughly normal draw (sum of four 16-bit uniforms, Irwin-Hall) for element i of the
// tensor keyed by seed, as mean + std * N(0, 1); integer math and one rounded multiply-add,
// so host and device agree bit for bit. mul = std / kSumStd.
constexpr float kSumStd = 37837.2f;  // standard deviation of the sum of four U{0..65535}
DS_W4_HD float random_value(uint64_t seed, uint64_t i, float mean, float mul) {
  const uint64_t h = mix64(seed ^ mix64(i));
  const int32_t s = int32_t(h & 0xffff) + int32_t((h >> 16) & 0xffff) +
                    int32_t((h >> 32) & 0xffff) + int32_t(h >> 48) - 131070;
  return add_rn(mean, mul_rn(float(s), mul));
}

}  // namespace ds::w4a16
