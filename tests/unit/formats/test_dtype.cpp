// fp16 / bf16 / fp8 conversions checked exhaustively against an independent reference that
// decodes with ldexp and rounds by searching the table of representable values.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace ds {
namespace {

double ref_fp16(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0) {
    v = std::ldexp(double(m), -24);
  } else if (e == 31) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else {
    v = std::ldexp(double(1024 + m), e - 25);
  }
  return (h & 0x8000) ? -v : v;
}

double ref_bf16(uint16_t h) {
  const int e = (h >> 7) & 0xff, m = h & 0x7f;
  double v;
  if (e == 0) {
    v = std::ldexp(double(m), -133);
  } else if (e == 255) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else {
    v = std::ldexp(double(128 + m), e - 134);
  }
  return (h & 0x8000) ? -v : v;
}

// Round-to-nearest-even by table search: `finite` holds the non-negative finite values in
// encoding order, `inf_value` is where rounding to infinity starts being nearer (one ulp
// past the largest finite value), `inf_code` the encoding of +infinity.
uint16_t ref_round(double x, const std::vector<double>& finite, double inf_value,
                   uint16_t inf_code) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  const auto it = std::lower_bound(finite.begin(), finite.end(), a);
  uint16_t code;
  if (it == finite.end()) {
    const double lo = finite.back();
    const double d_lo = a - lo, d_hi = inf_value - a;
    // The largest finite encoding is odd, so a tie goes to infinity.
    code = d_lo < d_hi ? uint16_t(finite.size() - 1) : inf_code;
  } else if (*it == a || it == finite.begin()) {
    code = uint16_t(it - finite.begin());
  } else {
    const auto hi = uint16_t(it - finite.begin()), lo = uint16_t(hi - 1);
    const double d_lo = a - finite[lo], d_hi = finite[hi] - a;
    code = d_lo < d_hi ? lo : d_hi < d_lo ? hi : (lo % 2 == 0 ? lo : hi);
  }
  return uint16_t(sign | code);
}

float bits_to_float(uint32_t b) {
  return std::bit_cast<float>(b);
}

// Floats around every representable value and every midpoint, plus random ones.
std::vector<float> probe_floats(const std::vector<double>& finite) {
  std::vector<float> xs;
  auto around = [&](double v) {
    const auto f = float(v);
    for (const float g : {f, std::nextafter(f, 0.0f), std::nextafter(f, INFINITY)}) {
      xs.push_back(g);
      xs.push_back(-g);
    }
  };
  for (size_t i = 0; i < finite.size(); ++i) {
    around(finite[i]);
    if (i + 1 < finite.size()) around((finite[i] + finite[i + 1]) / 2);
  }
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<double> exp(-140, 130);
  for (int i = 0; i < 200000; ++i) {
    const float r = bits_to_float(bits(rng));
    if (!std::isnan(r)) xs.push_back(r);
    xs.push_back(float(std::ldexp(1.0 + (bits(rng) & 0xffffff) / 16777216.0, int(exp(rng)))));
  }
  return xs;
}

TEST(Dtype, Fp16DecodeAllValues) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = fp16_to_f32(uint16_t(h));
    const double want = ref_fp16(uint16_t(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(double(got), want) << "fp16 0x" << std::hex << h;
      EXPECT_EQ(std::signbit(got), std::signbit(want)) << h;
    }
  }
}

TEST(Dtype, Fp16RoundTripAllValues) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = f32_to_fp16(fp16_to_f32(uint16_t(h)));
    if (std::isnan(ref_fp16(uint16_t(h)))) {
      EXPECT_TRUE(std::isnan(ref_fp16(back))) << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << h;
    } else {
      ASSERT_EQ(back, h) << "fp16 0x" << std::hex << h;
    }
  }
}

TEST(Dtype, Fp16RoundingMatchesReference) {
  std::vector<double> finite;
  for (uint16_t h = 0; h <= 0x7bff; ++h) finite.push_back(ref_fp16(h));
  const double inf_value = 65536.0;  // 65504 + one ulp (32)
  for (const float x : probe_floats(finite)) {
    const uint16_t want = ref_round(double(x), finite, inf_value, 0x7c00);
    ASSERT_EQ(f32_to_fp16(x), want)
        << "x = " << x << " (bits 0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
  }
  EXPECT_EQ(f32_to_fp16(INFINITY), 0x7c00);
  EXPECT_EQ(f32_to_fp16(-INFINITY), 0xfc00);
  EXPECT_TRUE(std::isnan(fp16_to_f32(f32_to_fp16(NAN))));
  EXPECT_EQ(f32_to_fp16(65519.996f), 0x7bff);
  EXPECT_EQ(f32_to_fp16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_fp16(std::ldexp(1.0f, -25)), 0);  // tie between 0 and the smallest: even
  EXPECT_EQ(f32_to_fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 1);
}

TEST(Dtype, Bf16DecodeAllValues) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = bf16_to_f32(uint16_t(h));
    const double want = ref_bf16(uint16_t(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(double(got), want) << "bf16 0x" << std::hex << h;
      EXPECT_EQ(std::signbit(got), std::signbit(want)) << h;
    }
  }
}

TEST(Dtype, Bf16RoundTripAllValues) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = f32_to_bf16(bf16_to_f32(uint16_t(h)));
    if (std::isnan(ref_bf16(uint16_t(h)))) {
      EXPECT_TRUE(std::isnan(ref_bf16(back))) << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << h;
    } else {
      ASSERT_EQ(back, h) << "bf16 0x" << std::hex << h;
    }
  }
}

TEST(Dtype, Bf16RoundingMatchesReference) {
  std::vector<double> finite;
  for (uint16_t h = 0; h <= 0x7f7f; ++h) finite.push_back(ref_bf16(h));
  const double inf_value = std::ldexp(1.0, 128);
  for (const float x : probe_floats(finite)) {
    if (std::isinf(x)) continue;
    const uint16_t want = ref_round(double(x), finite, inf_value, 0x7f80);
    ASSERT_EQ(f32_to_bf16(x), want)
        << "x = " << x << " (bits 0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
  }
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xff80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  // Every NaN, signalling ones included, stays NaN.
  for (const uint32_t nan_bits : {0x7f800001u, 0x7fc00000u, 0xff800001u, 0x7fffffffu}) {
    EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(bits_to_float(nan_bits))))) << nan_bits;
  }
}

TEST(Dtype, Fp8DecodeAllValues) {
  for (uint32_t v = 0; v < 256; ++v) {
    const int s = v >> 7;
    // E4M3 (no infinities; only S.1111.111 is NaN)
    const int e4 = (v >> 3) & 0xf, m3 = v & 7;
    const float g4 = fp8_e4m3_to_f32(uint8_t(v));
    if (e4 == 15 && m3 == 7) {
      EXPECT_TRUE(std::isnan(g4)) << v;
    } else {
      double w = e4 == 0 ? std::ldexp(double(m3), -9) : std::ldexp(double(8 + m3), e4 - 10);
      if (s) w = -w;
      EXPECT_EQ(double(g4), w) << "e4m3 " << v;
    }
    // E5M2 (IEEE-like)
    const int e5 = (v >> 2) & 0x1f, m2 = v & 3;
    const float g5 = fp8_e5m2_to_f32(uint8_t(v));
    if (e5 == 31 && m2 != 0) {
      EXPECT_TRUE(std::isnan(g5)) << v;
    } else {
      double w = e5 == 31  ? std::numeric_limits<double>::infinity()
                 : e5 == 0 ? std::ldexp(double(m2), -16)
                           : std::ldexp(double(4 + m2), e5 - 17);
      if (s) w = -w;
      EXPECT_EQ(double(g5), w) << "e5m2 " << v;
    }
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e5m2_to_f32(0x7b), 57344.0f);
}

TEST(Dtype, TablesAndSizes) {
  const std::vector<std::pair<uint32_t, DType>> ggml = {
      {0, DType::F32},   {1, DType::F16},   {2, DType::Q4_0},  {3, DType::Q4_1},
      {6, DType::Q5_0},  {7, DType::Q5_1},  {8, DType::Q8_0},  {9, DType::Q8_1},
      {10, DType::Q2_K}, {11, DType::Q3_K}, {12, DType::Q4_K}, {13, DType::Q5_K},
      {14, DType::Q6_K}, {15, DType::Q8_K}, {24, DType::I8},   {25, DType::I16},
      {26, DType::I32},  {27, DType::I64},  {28, DType::F64},  {30, DType::BF16}};
  for (const auto& [id, t] : ggml) {
    EXPECT_EQ(dtype_from_ggml(id), t) << id;
    EXPECT_EQ(dtype_to_ggml(t), id) << id;
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t) << id;
  }
  for (const uint32_t id : {4u, 5u, 16u, 23u, 29u, 31u, 39u, 1000u})
    EXPECT_EQ(dtype_from_ggml(id), std::nullopt) << id;
  EXPECT_EQ(dtype_bytes(DType::Q4_1, 1536), 1536u / 32 * 20);
  EXPECT_EQ(dtype_bytes(DType::Q6_K, 512), 420u);
  EXPECT_EQ(dtype_bytes(DType::BF16, 3), 6u);
  EXPECT_THROW(dtype_bytes(DType::Q8_0, 33), Error);
  EXPECT_THROW(dtype_bytes(DType::F32, -1), Error);
  // Sizes that do not fit in 64 bits are an error, not a wrapped number.
  EXPECT_THROW(dtype_bytes(DType::F64, int64_t(1) << 62), Error);
  EXPECT_EQ(dtype_bytes(DType::U8, std::numeric_limits<int64_t>::max()),
            size_t(std::numeric_limits<int64_t>::max()));
  EXPECT_EQ(dtype_from_name("nope"), std::nullopt);
}

}  // namespace
}  // namespace ds
