// Block formats against gguf-py (tools/make_quant_fixtures.py), plus quantizer invariants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/quants.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace ds::cpu {
namespace {

nlohmann::json load_fixture(const std::string& name) {
  const std::string path = std::string(DS_FIXTURES_DIR) + "/quants/" + name + ".json";
  std::ifstream f(path);
  if (!f) throw std::runtime_error("missing fixture " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::vector<uint8_t> unhex(const std::string& s) {
  std::vector<uint8_t> out(s.size() / 2);
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = uint8_t(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return out;
}

std::vector<float> unhex_f32(const std::string& s) {
  const auto b = unhex(s);
  std::vector<float> f(b.size() / 4);
  std::memcpy(f.data(), b.data(), b.size());
  return f;
}

DType type_of(const nlohmann::json& j) {
  return *dtype_from_name(j["type"].get<std::string>());
}

// Bitwise, so a -0.0 / 0.0 or NaN mismatch shows too.
void expect_same_floats(const std::vector<float>& got, const std::vector<float>& want,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
        << what << " element " << i << ": " << got[i] << " vs gguf-py " << want[i];
}

class DequantizeFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(DequantizeFixture, MatchesGgufPy) {
  const auto j = load_fixture(GetParam());
  const DType t = type_of(j);
  const int64_t n = j["n"].get<int64_t>();
  const auto blocks = unhex(j["blocks"].get<std::string>());
  ASSERT_EQ(blocks.size(), dtype_bytes(t, n));
  std::vector<float> got(size_t(n), NAN);
  dequantize_row(t, blocks.data(), got.data(), n);
  expect_same_floats(got, unhex_f32(j["dequantized"].get<std::string>()), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Quants, DequantizeFixture,
                         ::testing::Values("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k",
                                           "q6_k"));

class QuantizeFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizeFixture, BytesMatchGgufPy) {
  const auto j = load_fixture(GetParam());
  const DType t = type_of(j);
  const int64_t n = j["n"].get<int64_t>();
  const auto src = unhex_f32(j["source"].get<std::string>());
  const auto want = unhex(j["quantized"].get<std::string>());
  std::vector<uint8_t> got(dtype_bytes(t, n));
  quantize_row(t, src.data(), got.data(), n);
  ASSERT_EQ(got.size(), want.size());
  const int bs = dtype_info(t).type_size;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(int(got[i]), int(want[i]))
        << GetParam() << " byte " << i << " (block " << i / bs << ", offset " << i % bs << ")";
  std::vector<float> deq(static_cast<size_t>(n));
  dequantize_row(t, got.data(), deq.data(), n);
  expect_same_floats(deq, unhex_f32(j["dequantized"].get<std::string>()), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Quants, QuantizeFixture,
                         ::testing::Values("q4_0_quantize", "q4_1_quantize", "q8_0_quantize",
                                           "bf16_quantize"));

std::vector<float> random_row(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = dist(rng);
  return x;
}

TEST(Quantize, Q8_1StoresScaledSums) {
  const int64_t n = 128;
  const auto x = random_row(n, 7);
  std::vector<BlockQ8_1> q1(n / 32);
  std::vector<BlockQ8_0> q0(n / 32);
  quantize_row(DType::Q8_1, x.data(), q1.data(), n);
  quantize_row(DType::Q8_0, x.data(), q0.data(), n);
  for (size_t b = 0; b < q1.size(); ++b) {
    EXPECT_EQ(q1[b].d, q0[b].d);
    EXPECT_EQ(std::memcmp(q1[b].qs, q0[b].qs, 32), 0);
    int sum = 0;
    for (int8_t v : q1[b].qs) sum += v;
    const float d = fp16_to_f32(q1[b].d);
    EXPECT_NEAR(fp16_to_f32(q1[b].s), d * float(sum), std::fabs(d * float(sum)) * 1e-3f + 1e-6f);
  }
}

TEST(Quantize, Q8_KRoundTripAndGroupSums) {
  const int64_t n = 512;
  auto x = random_row(n, 11, 3.0f);
  std::fill(x.begin() + 256, x.end(), 0.0f);  // the second super-block is all zero
  std::vector<BlockQ8_K> q(n / 256);
  quantize_row(DType::Q8_K, x.data(), q.data(), n);
  std::vector<float> y(static_cast<size_t>(n));
  dequantize_row(DType::Q8_K, q.data(), y.data(), n);
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(y[size_t(i)], x[size_t(i)], std::fabs(q[i / 256].d) * 0.5001f);
  for (const auto& b : q)
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += b.qs[g * 16 + l];
      EXPECT_EQ(b.bsums[g], sum);
    }
  EXPECT_EQ(q[1].d, 0.0f);
}

// Activation blocks follow llama.cpp's x86 SIMD quantizers, not the _ref rounding:
// q = nearest-even(x * (127 / amax)), d = fp16(amax / 127), s = fp16(amax / 127 * sum(q)).
TEST(Quantize, ActivationBlocksFollowLlamaCppSimdRounding) {
  const int64_t n = 128;
  auto x = random_row(n, 3);
  x[64] = 127.0f;  // block 2: 127 / amax = 1, so x.5 values are exact ties
  for (int i = 65; i < 96; ++i) x[size_t(i)] = float(i - 80) + 0.5f;
  std::fill(x.begin() + 96, x.end(), 0.0f);  // block 3: all zero
  std::vector<ActBlock> a(n / 32);
  quantize_row_act(x.data(), a.data(), n);
  for (size_t b = 0; b < a.size(); ++b) {
    float amax = 0;
    for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(x[b * 32 + size_t(e)]));
    const float d = amax / 127.f, id = amax != 0 ? 127.f / amax : 0.f;
    int sum = 0;
    for (int e = 0; e < 32; ++e) {
      const int q = int(std::nearbyint(x[b * 32 + size_t(e)] * id));
      EXPECT_EQ(int(a[b].qs[e]), q) << "block " << b << " element " << e;
      sum += q;
    }
    EXPECT_EQ(a[b].d, fp16_to_f32(f32_to_fp16(d))) << "block " << b;
    EXPECT_EQ(a[b].s, fp16_to_f32(f32_to_fp16(d * float(sum)))) << "block " << b;
  }
  EXPECT_EQ(a[2].qs[1], -14);  // -14.5: half to even, where roundf gives -15
  EXPECT_EQ(a[2].qs[2], -14);  // -13.5
  EXPECT_EQ(a[3].d, 0.0f);
}

// llama.cpp's own quantize_row_q8_0 / q8_1 and vec_dot kernels (x86 AVX-512 build, run
// through ctypes by tools/make_quant_fixtures.py --ggml-cpu): the Q8 activation mode must
// give the same activation bytes and the same dot product bits on every ISA.
TEST(Quantize, Q8ModeReproducesLlamaCppBits) {
  const auto j = load_fixture("llamacpp_q8_dots");
  const int64_t K = j["k"], M = j["m"], N = j["n"];
  const auto x = unhex_f32(j["x"]);
  std::vector<ActBlock> act(size_t(K / 32));
  for (int64_t m = 0; m < M; ++m) {
    quantize_row_act(x.data() + m * K, act.data(), K);
    const auto q8_0 = unhex(j["q8_0"][size_t(m)]), q8_1 = unhex(j["q8_1"][size_t(m)]);
    for (int64_t b = 0; b < K / 32; ++b) {
      BlockQ8_0 b0;
      BlockQ8_1 b1;
      std::memcpy(&b0, q8_0.data() + b * sizeof(BlockQ8_0), sizeof(b0));
      std::memcpy(&b1, q8_1.data() + b * sizeof(BlockQ8_1), sizeof(b1));
      const ActBlock& a = act[size_t(b)];
      ASSERT_EQ(std::memcmp(a.qs, b0.qs, 32), 0) << "row " << m << " block " << b;
      ASSERT_EQ(std::memcmp(a.qs, b1.qs, 32), 0) << "row " << m << " block " << b;
      EXPECT_EQ(a.d, fp16_to_f32(b0.d)) << "row " << m << " block " << b;
      EXPECT_EQ(a.d, fp16_to_f32(b1.d)) << "row " << m << " block " << b;
      EXPECT_EQ(a.s, fp16_to_f32(b1.s)) << "row " << m << " block " << b;
    }
  }
  ThreadPool pool(2);
  for (const auto& c : j["types"]) {
    const DType t = type_of(c);
    const auto w = unhex(c["weights"]);
    const auto want = unhex_f32(c["dots"]);
    for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni}) {
      if (!isa_supported(isa)) continue;
      for (int64_t rows : {int64_t(1), M}) {  // GEMV and the tiles
        std::vector<float> out(size_t(M * N), NAN);
        for (int64_t m0 = 0; m0 < M; m0 += rows) {
          MatmulArgs a;
          a.x = x.data() + m0 * K;
          a.M = rows;
          a.K = K;
          a.ldx = K;
          a.w = w.data();
          a.wtype = t;
          a.N = N;
          a.w_row_bytes = dtype_bytes(t, K);
          a.out = out.data() + m0 * N;
          a.ldo = N;
          a.act = ActPrecision::Q8;
          matmul(a, pool, isa);
        }
        expect_same_floats(out, want,
                           std::string(dtype_name(t)) + " " + std::string(isa_name(isa)) +
                               " M=" + std::to_string(rows));
      }
    }
  }
}

TEST(Quantize, RejectsPartialBlocksAndUnknownTypes) {
  std::vector<float> x(40, 1.0f);
  std::vector<uint8_t> buf(1024);
  EXPECT_THROW(quantize_row(DType::Q8_0, x.data(), buf.data(), 40), Error);
  EXPECT_THROW(quantize_row(DType::Q6_K, x.data(), buf.data(), 256), UnsupportedError);
  EXPECT_THROW(dequantize_row(DType::Q2_K, buf.data(), x.data(), 256), UnsupportedError);
}

TEST(CpuFeatures, DetectionIsConsistent) {
  const Isa best = detect_isa();
  EXPECT_TRUE(isa_supported(Isa::Scalar));
  EXPECT_TRUE(isa_supported(best));
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx}) {
    EXPECT_EQ(isa_from_name(isa_name(isa)), isa);
    if (int(isa) <= int(best)) {
      EXPECT_TRUE(isa_supported(isa)) << isa_name(isa);
    }
  }
  EXPECT_EQ(select_isa(""), best);
  EXPECT_EQ(select_isa("auto"), best);
  EXPECT_EQ(select_isa("scalar"), Isa::Scalar);
  EXPECT_EQ(select_isa("amx"), best);  // never above what the CPU runs
  EXPECT_THROW(select_isa("sse9"), Error);
  const CpuFeatures& f = cpu_features();
  if (f.avx512vnni && f.os_avx512) {
    EXPECT_GE(int(best), int(Isa::Avx512Vnni));
  }
  EXPECT_FALSE(describe(f).empty());
}

}  // namespace
}  // namespace ds::cpu
