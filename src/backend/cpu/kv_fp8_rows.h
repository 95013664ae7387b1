// Reading FP8 KV cache rows on the CPU: codes through a 256-entry table, times the slot's
// scale, so a row is exactly what kvfp8::dequant gives (one F32 product per element).
#pragma once

#include <array>
#include <cstdint>

namespace ds::cpu {

// Where one head's scales are: scales[slot * stride + offset] (+1 for dims >= split > 0).
struct Fp8Scales {
  const float* scales = nullptr;
  int64_t stride = 0;
  int64_t offset = 0;
  int split = 0;
};

// e4m3 code -> float for all 256 codes (fp8w::decode); defined in a baseline-ISA file so
// the per-ISA kernels that include this header share no inline code with different flags.
const std::array<float, 256>& fp8_decode_table();

namespace {
// n values of the head row at codes (slot `slot`) as F32 (or wider) into dst.
template <typename Out>
void dequant_fp8_row(const uint8_t* codes, const Fp8Scales& f, int64_t slot, int n, Out* dst) {
  const std::array<float, 256>& lut = fp8_decode_table();
  const float* s = f.scales + slot * f.stride + f.offset;
  const int split = f.split > 0 ? f.split : n;
  for (int i = 0; i < split; ++i) dst[i] = Out(lut[codes[i]] * s[0]);
  for (int i = split; i < n; ++i) dst[i] = Out(lut[codes[i]] * s[1]);
}
}  // namespace

}  // namespace ds::cpu
