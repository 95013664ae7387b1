// Element types: plain floats and ints plus GGML block-quantized formats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace ds {

enum class DType : uint8_t {
  F32,
  F16,
  BF16,
  F64,
  F8_E4M3,
  F8_E5M2,
  I8,
  U8,
  I16,
  I32,
  I64,
  Bool,
  // GGML block formats (block_size elements stored in type_size bytes).
  Q4_0,
  Q4_1,
  Q5_0,
  Q5_1,
  Q8_0,
  Q8_1,
  Q2_K,
  Q3_K,
  Q4_K,
  Q5_K,
  Q6_K,
  Q8_K,
  // deepserve's 4-bit weights (backend/w4a16.h): 128 codes + a BF16 scale per block; rows are
  // padded to 16 bytes, so make views with w4a16 helpers, not TensorView::contiguous.
  W4A16,
  // deepserve's FP8 weights (backend/fp8w.h): e4m3 codes + an F32 scale per row and 128-group;
  // rows padded to 16 bytes (make views with fp8w helpers). block_size 1: any K.
  FP8W,
};

struct DTypeInfo {
  std::string_view name;
  int block_size;  // elements per block (1 for plain types)
  int type_size;   // bytes per block
  bool quantized;
};

const DTypeInfo& dtype_info(DType t);
// GGML's block formats (Q4_0 .. Q8_K), as GGUF files store them.
inline bool ggml_block_type(DType t) {
  return t >= DType::Q4_0 && t <= DType::Q8_K;
}
inline std::string_view dtype_name(DType t) {
  return dtype_info(t).name;
}
// Bytes taken by n elements; throws if n is not a whole number of blocks.
size_t dtype_bytes(DType t, int64_t n);
std::optional<DType> dtype_from_name(std::string_view name);
// GGML's numeric type ids (ggml_type) <-> DType; nullopt for ids we do not read.
std::optional<DType> dtype_from_ggml(uint32_t ggml_type);
uint32_t dtype_to_ggml(DType t);

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_fp16(float f);  // round to nearest even

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return uint16_t((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

float fp8_e4m3_to_f32(uint8_t v);
float fp8_e5m2_to_f32(uint8_t v);

}  // namespace ds
