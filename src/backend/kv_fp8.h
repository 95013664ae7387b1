// FP8 KV cache rows (PagedKv with dtype F8_E4M3): e4m3 codes with one F32 scale per part of a
// head row. Host and device share these functions (included by .cu files), so the CPU and CUDA
// stores write identical bits and every reader dequantizes the same way.
#pragma once

#include "backend/fp8w.h"

namespace ds::kvfp8 {

// Scale of a part whose largest magnitude is amax: the largest value maps to e4m3's 448
// (no calibration needed); an all-zero part gets 1 so its codes decode to 0.
DS_F8_HD float scale_of(float amax) {
  return amax > 0.0f ? amax / fp8w::kMax : 1.0f;
}

// Quantizes x[0, n) into codes with scale s (code = e4m3(x / s), RNE, saturating).
DS_F8_HD void encode_part(const float* x, int n, float s, uint8_t* codes) {
  for (int i = 0; i < n; ++i) codes[i] = fp8w::encode(x[i] / s);
}

// One head row of n values: parts [0, split) and [split, n) when 0 < split, else one part.
// Writes n codes and 1 or 2 scales.
DS_F8_HD void quantize_head(const float* x, int n, int split, uint8_t* codes, float* scales) {
  const int bounds[3] = {0, split > 0 ? split : n, n};
  const int parts = split > 0 ? 2 : 1;
  for (int p = 0; p < parts; ++p) {
    float amax = 0.0f;
    for (int i = bounds[p]; i < bounds[p + 1]; ++i) amax = fmaxf(amax, fabsf(x[i]));
    scales[p] = scale_of(amax);
    encode_part(x + bounds[p], bounds[p + 1] - bounds[p], scales[p], codes + bounds[p]);
  }
}

// The value a reader sees: decode(code) * scale, one F32 rounding.
DS_F8_HD float dequant(uint8_t code, float scale) {
  return fp8w::decode(code) * scale;
}

}  // namespace ds::kvfp8
