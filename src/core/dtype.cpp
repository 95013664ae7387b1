#include "core/dtype.h"

#include <array>
#include <cmath>

#include "core/error.h"

namespace ds {
namespace {

constexpr std::array<DTypeInfo, 26> kInfo = {{
    {"F32", 1, 4, false},     {"F16", 1, 2, false},     {"BF16", 1, 2, false},
    {"F64", 1, 8, false},     {"F8_E4M3", 1, 1, false}, {"F8_E5M2", 1, 1, false},
    {"I8", 1, 1, false},      {"U8", 1, 1, false},      {"I16", 1, 2, false},
    {"I32", 1, 4, false},     {"I64", 1, 8, false},     {"BOOL", 1, 1, false},
    {"Q4_0", 32, 18, true},   {"Q4_1", 32, 20, true},   {"Q5_0", 32, 22, true},
    {"Q5_1", 32, 24, true},   {"Q8_0", 32, 34, true},   {"Q8_1", 32, 36, true},
    {"Q2_K", 256, 84, true},  {"Q3_K", 256, 110, true}, {"Q4_K", 256, 144, true},
    {"Q5_K", 256, 176, true}, {"Q6_K", 256, 210, true}, {"Q8_K", 256, 292, true},
    {"W4A16", 128, 66, true}, {"FP8W", 1, 1, true},
}};

struct GgmlId {
  uint32_t id;
  DType type;
};
// ggml_type enum values (ggml.h).
constexpr std::array<GgmlId, 20> kGgml = {{
    {0, DType::F32},   {1, DType::F16},   {2, DType::Q4_0},  {3, DType::Q4_1},  {6, DType::Q5_0},
    {7, DType::Q5_1},  {8, DType::Q8_0},  {9, DType::Q8_1},  {10, DType::Q2_K}, {11, DType::Q3_K},
    {12, DType::Q4_K}, {13, DType::Q5_K}, {14, DType::Q6_K}, {15, DType::Q8_K}, {24, DType::I8},
    {25, DType::I16},  {26, DType::I32},  {27, DType::I64},  {28, DType::F64},  {30, DType::BF16},
}};

}  // namespace

const DTypeInfo& dtype_info(DType t) {
  const auto i = static_cast<size_t>(t);
  if (i >= kInfo.size()) throw Error("invalid dtype id " + std::to_string(i));
  return kInfo[i];
}

size_t dtype_bytes(DType t, int64_t n) {
  const auto& info = dtype_info(t);
  if (n < 0 || n % info.block_size != 0)
    throw Error(std::to_string(n) + " elements is not a whole number of " + std::string(info.name) +
                " blocks of " + std::to_string(info.block_size));
  size_t bytes = 0;
  if (__builtin_mul_overflow(size_t(n / info.block_size), size_t(info.type_size), &bytes))
    throw Error(std::to_string(n) + " elements of " + std::string(info.name) +
                " take more bytes than fit in 64 bits");
  return bytes;
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (size_t i = 0; i < kInfo.size(); ++i)
    if (kInfo[i].name == name) return static_cast<DType>(i);
  return std::nullopt;
}

std::optional<DType> dtype_from_ggml(uint32_t ggml_type) {
  for (const auto& g : kGgml)
    if (g.id == ggml_type) return g.type;
  return std::nullopt;
}

uint32_t dtype_to_ggml(DType t) {
  for (const auto& g : kGgml)
    if (g.type == t) return g.id;
  throw Error("dtype " + std::string(dtype_name(t)) + " has no GGML type id");
}

uint16_t f32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffff;
  if (x > 0x7f800000) return uint16_t(sign | 0x7e00);   // NaN
  if (x >= 0x477ff000) return uint16_t(sign | 0x7c00);  // overflow (>= 65520) -> inf
  if (x < 0x38800000) {                                 // subnormal or zero in fp16
    if (x < 0x33000000) return uint16_t(sign);          // below half the smallest subnormal
    const uint32_t exp = x >> 23;
    const uint32_t mant = (x & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp) + ... lands mantissa at fp16 subnormal
    uint32_t v = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (v & 1))) ++v;
    return uint16_t(sign | v);
  }
  uint32_t v = ((x >> 13) - (112u << 10));
  const uint32_t rem = x & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (v & 1))) ++v;
  return uint16_t(sign | v);
}

float fp8_e4m3_to_f32(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, mant = v & 7;
  if (exp == 0xf && mant == 7) return NAN;
  float r = exp == 0 ? std::ldexp(float(mant) / 8.0f, -6)
                     : std::ldexp(1.0f + float(mant) / 8.0f, exp - 7);
  return sign ? -r : r;
}

float fp8_e5m2_to_f32(uint8_t v) {
  return fp16_to_f32(uint16_t(v) << 8);
}

}  // namespace ds
