// Random GGUF block-quantized rows for the GGUF kernel tests: random quant bits (every bit
// pattern is a valid block) with the fp16 scales (and mins) overwritten by sane values, so a
// row dequantizes to weights of about `scale` magnitude; and their CPU dequantization.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/quants.h"
#include "core/dtype.h"

namespace ds::test {

inline constexpr DType kGgufTypes[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,
                                       DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K};

// rows x k elements of type t, row-major, rows packed.
inline std::vector<uint8_t> random_gguf_rows(DType t, int64_t rows, int64_t k, uint32_t seed,
                                             float scale = 0.05f) {
  const DTypeInfo& info = dtype_info(t);
  const int64_t nb = rows * (k / info.block_size);
  std::vector<uint8_t> b(size_t(nb * info.type_size));
  std::mt19937 rng(seed);
  for (auto& v : b) v = uint8_t(rng());
  std::uniform_real_distribution<float> u(0.25f, 1.0f);
  auto put = [&](uint8_t* p, float v) {
    const uint16_t h = f32_to_fp16(v);
    std::memcpy(p, &h, 2);
  };
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* p = b.data() + i * info.type_size;
    const float sign = (rng() & 1) ? 1.0f : -1.0f;
    switch (t) {
      case DType::Q4_0:
      case DType::Q5_0:
        put(p, sign * scale * u(rng) / 8);
        break;
      case DType::Q4_1:
      case DType::Q5_1:  // x = d q + m, centred near zero
        put(p, scale * u(rng) / 8);
        put(p + 2, -scale * u(rng));
        break;
      case DType::Q8_0:
        put(p, sign * scale * u(rng) / 64);
        break;
      case DType::Q4_K:
      case DType::Q5_K:  // d * sc * q - dmin * m with 6-bit sc, m
        put(p, scale * u(rng) / 256);
        put(p + 2, scale * u(rng) / 128);
        break;
      case DType::Q6_K:
        put(p + 208, sign * scale * u(rng) / 1024);
        break;
      default:
        break;
    }
  }
  return b;
}

// The CPU reference dequantization of such rows.
inline std::vector<float> dequantize_rows(DType t, const std::vector<uint8_t>& b, int64_t rows,
                                          int64_t k) {
  std::vector<float> out(size_t(rows * k));
  const int64_t row_bytes = k / dtype_info(t).block_size * dtype_info(t).type_size;
  for (int64_t r = 0; r < rows; ++r)
    cpu::dequantize_row_ref(t, b.data() + r * row_bytes, out.data() + r * k, k);
  return out;
}

}  // namespace ds::test
