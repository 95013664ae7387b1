// matmul for every weight type and every ISA this CPU runs: against an F64 reference on
// the dequantized operands, and bit-for-bit determinism across M, row subsets, weight-row
// offsets and thread counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/quants.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace ds::cpu {
namespace {

const DType kTypes[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q4_0,
                        DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0,
                        DType::Q4_K, DType::Q5_K, DType::Q6_K};

std::vector<Isa> runnable_isas() {
  std::vector<Isa> v;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx})
    if (isa_supported(isa)) v.push_back(isa);
  return v;
}

bool is_k_quant(DType t) {
  return dtype_info(t).block_size == 256;
}

// Offsets of the fp16 scale fields in a block of the types quantize_row cannot make.
std::vector<size_t> fp16_fields(DType t) {
  switch (t) {
    case DType::Q5_0:
      return {0};
    case DType::Q6_K:
      return {208};
    default:  // Q5_1, Q4_K, Q5_K
      return {0, 2};
  }
}

bool has_quantizer(DType t) {
  return !dtype_info(t).quantized || t == DType::Q4_0 || t == DType::Q4_1 || t == DType::Q8_0;
}

std::vector<float> random_floats(int64_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = dist(rng);
  return v;
}

// N rows of K weights in type t with row stride row_bytes (>= the packed size).
std::vector<uint8_t> make_weights(DType t, int64_t N, int64_t K, size_t row_bytes,
                                  std::mt19937& rng) {
  std::vector<uint8_t> w(size_t(N) * row_bytes, 0xcd);
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* row = w.data() + size_t(n) * row_bytes;
    if (has_quantizer(t)) {
      const auto f = random_floats(K, rng, 0.1f);
      quantize_row(t, f.data(), row, K);
      continue;
    }
    // No quantizer here: random bits with sane fp16 scales.
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> scale(-0.01f, 0.01f);
    const size_t bytes = dtype_bytes(t, K), bs = size_t(dtype_info(t).type_size);
    for (size_t i = 0; i < bytes; ++i) row[i] = uint8_t(byte(rng));
    for (size_t b = 0; b < bytes / bs; ++b) {
      uint8_t* blk = row + b * bs;
      for (size_t off : fp16_fields(t)) {
        const uint16_t h = f32_to_fp16(scale(rng));
        std::memcpy(blk + off, &h, 2);
      }
    }
  }
  return w;
}

bool is_block_type(DType t) {
  return dtype_info(t).quantized;
}

// The activations the kernels actually multiply: for block weights in Q8 mode, quantized
// (as llama.cpp's SIMD quantizers do) then dequantized; *s gets each 32-block's s for the
// Q4_1 min term ([M, K / 32]), which is fp16-rounded and so not quite d * sum(q).
std::vector<float> effective_x(DType t, ActPrecision act, const std::vector<float>& x, int64_t M,
                               int64_t K, int64_t ldx, std::vector<float>* s) {
  std::vector<float> out(static_cast<size_t>(M * K));
  std::vector<uint8_t> buf(is_k_quant(t) ? dtype_bytes(DType::Q8_K, K) : 0);
  std::vector<ActBlock> blocks(size_t(K / 32));
  if (s) s->assign(size_t(M * (K / 32)), 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x.data() + m * ldx;
    float* dst = out.data() + m * K;
    if (!is_block_type(t) || act == ActPrecision::F32) {
      std::memcpy(dst, src, size_t(K) * 4);
    } else if (is_k_quant(t)) {
      quantize_row(DType::Q8_K, src, buf.data(), K);
      dequantize_row(DType::Q8_K, buf.data(), dst, K);
    } else {
      quantize_row_act(src, blocks.data(), K);
      for (int64_t b = 0; b < K / 32; ++b) {
        for (int e = 0; e < 32; ++e)
          dst[b * 32 + e] = blocks[size_t(b)].d * blocks[size_t(b)].qs[e];
        if (s) (*s)[size_t(m * (K / 32) + b)] = blocks[size_t(b)].s;
      }
    }
  }
  return out;
}

struct Problem {
  DType t;
  int64_t M, N, K, ldx, ldo;
  size_t row_bytes;
  ActPrecision act = ActPrecision::F32;
  std::vector<float> x;
  std::vector<uint8_t> w;

  Problem(DType type, int64_t m, int64_t n, int64_t k, uint32_t seed, int64_t pad = 0,
          ActPrecision precision = ActPrecision::F32)
      : t(type), M(m), N(n), K(k), ldx(k + pad), ldo(n + pad), act(precision) {
    std::mt19937 rng(seed);
    row_bytes = dtype_bytes(t, K) + size_t(pad) * 4;
    x = random_floats(M * ldx, rng, 1.0f);
    w = make_weights(t, N, K, row_bytes, rng);
  }

  MatmulArgs args(float* out, int64_t row0 = 0, int64_t rows = -1, int64_t n0 = 0,
                  int64_t n = -1) const {
    MatmulArgs a;
    a.x = x.data() + row0 * ldx;
    a.M = rows < 0 ? M : rows;
    a.K = K;
    a.ldx = ldx;
    a.w = w.data() + size_t(n0) * row_bytes;
    a.wtype = t;
    a.N = n < 0 ? N : n;
    a.w_row_bytes = row_bytes;
    a.out = out;
    a.ldo = ldo;
    a.act = act;
    return a;
  }

  std::vector<float> run(ThreadPool& pool, Isa isa) const {
    std::vector<float> out(size_t(M * ldo), NAN);
    matmul(args(out.data()), pool, isa);
    return out;
  }
};

const char* precision_name(ActPrecision a) {
  return a == ActPrecision::F32 ? "f32-act" : "q8-act";
}

std::string describe(const Problem& p, Isa isa) {
  return std::string(dtype_name(p.t)) + " " + precision_name(p.act) + " " +
         std::string(isa_name(isa)) + " M=" + std::to_string(p.M) + " N=" + std::to_string(p.N) +
         " K=" + std::to_string(p.K);
}

// F64 sums over the dequantized operands, and sum |x w| as the scale of rounding errors.
struct Reference {
  std::vector<double> value, magnitude;  // [M, N]
};

Reference reference(const Problem& p) {
  std::vector<float> s;
  const bool q4_1_q8 = p.t == DType::Q4_1 && p.act == ActPrecision::Q8;
  const auto xe = effective_x(p.t, p.act, p.x, p.M, p.K, p.ldx, &s);
  std::vector<float> wrow(static_cast<size_t>(p.K));
  Reference r;
  r.value.resize(size_t(p.M * p.N));
  r.magnitude.resize(size_t(p.M * p.N));
  for (int64_t n = 0; n < p.N; ++n) {
    const uint8_t* wq = p.w.data() + size_t(n) * p.row_bytes;
    dequantize_row(p.t, wq, wrow.data(), p.K);
    for (int64_t m = 0; m < p.M; ++m) {
      double v = 0, a = 0;
      for (int64_t k = 0; k < p.K; ++k) {
        const double e = double(xe[size_t(m * p.K + k)]) * double(wrow[size_t(k)]);
        v += e;
        a += std::fabs(e);
      }
      if (q4_1_q8) {  // the min term uses s, not sum(x): m * (s - sum(x)) per block
        const auto* blocks = reinterpret_cast<const BlockQ4_1*>(wq);
        for (int64_t b = 0; b < p.K / 32; ++b) {
          double sx = 0;
          for (int e = 0; e < 32; ++e) sx += xe[size_t(m * p.K + b * 32 + e)];
          v += double(fp16_to_f32(blocks[b].m)) * (double(s[size_t(m * (p.K / 32) + b)]) - sx);
        }
      }
      r.value[size_t(m * p.N + n)] = v;
      r.magnitude[size_t(m * p.N + n)] = a;
    }
  }
  return r;
}

// Tolerance relative to sum |x w|: Q8 mode sums exact integer products in F32 per block.
double tolerance(ActPrecision act) {
  return act == ActPrecision::F32 ? 1e-5 : 1e-4;
}

std::vector<ActPrecision> precisions_for(DType t) {
  if (!matmul_supports(t, ActPrecision::Q8) || !is_block_type(t)) return {ActPrecision::F32};
  return {ActPrecision::F32, ActPrecision::Q8};
}

TEST(Matmul, MatchesF64ReferenceOnAwkwardShapes) {
  ThreadPool pool(2);
  const auto isas = runnable_isas();
  uint32_t seed = 1;
  for (DType t : kTypes)
    for (ActPrecision act : precisions_for(t))
      for (int64_t K : {32, 256, 576, 800, 1536}) {  // 800: an odd number of blocks
        if (is_k_quant(t) && K % 256 != 0) continue;
        for (int64_t N : {1, 5, 64, 97, 576})
          for (int64_t M : {1, 3, 7, 16, 33}) {
            const Problem p(t, M, N, K, seed++, M == 7 ? 3 : 0, act);
            const Reference ref = reference(p);
            for (Isa isa : isas) {
              const auto out = p.run(pool, isa);
              for (int64_t m = 0; m < M; ++m)
                for (int64_t n = 0; n < N; ++n) {
                  const size_t i = size_t(m * N + n);
                  ASSERT_NEAR(out[size_t(m * p.ldo + n)], ref.value[i],
                              tolerance(act) * ref.magnitude[i])
                      << describe(p, isa) << " at m=" << m << " n=" << n;
                }
              if (p.ldo > N) {  // the padding between output rows is left alone
                for (int64_t m = 0; m < M; ++m) ASSERT_TRUE(std::isnan(out[size_t(m * p.ldo + N)]));
              }
            }
          }
      }
}

TEST(Matmul, SimdMatchesScalarWithinRounding) {
  ThreadPool pool(1);
  for (DType t : kTypes)
    for (ActPrecision act : precisions_for(t)) {
      const Problem p(t, 9, 37, 1536, 99, 0, act);
      const Reference ref = reference(p);
      const auto want = p.run(pool, Isa::Scalar);
      for (Isa isa : runnable_isas()) {
        const auto got = p.run(pool, isa);
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_NEAR(got[i], want[i], 1e-5 * ref.magnitude[i]) << describe(p, isa) << " at " << i;
      }
    }
}

// In Q8 mode every ISA runs llama.cpp's vec_dot sequence for the 32-element types, so the
// SIMD kernels must reproduce the scalar reference bit for bit.
TEST(Matmul, Q8ModeSimdEqualsScalarBitwise) {
  ThreadPool pool(2);
  for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0})
    for (int64_t M : {1, 6}) {
      const Problem p(t, M, 45, 800, 7, 0, ActPrecision::Q8);
      const auto want = p.run(pool, Isa::Scalar);
      for (Isa isa : runnable_isas()) {
        const auto got = p.run(pool, isa);
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
              << describe(p, isa) << " at " << i << ": " << got[i] << " vs " << want[i];
      }
    }
}

void expect_bits_equal(const float* got, const float* want, int64_t n, const std::string& what) {
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(std::memcmp(got + i, want + i, 4), 0)
        << what << " element " << i << ": " << got[i] << " vs " << want[i];
}

TEST(Matmul, BitwiseDeterministicAcrossBatchingTilingAndThreads) {
  ThreadPool pool1(1), pool2(2), pool3(3);
  ThreadPool* pools[] = {&pool1, &pool2, &pool3};
  struct Shape {
    int64_t M, N, K;
  };
  for (DType t : kTypes)
    for (ActPrecision act : precisions_for(t))
      for (Shape s : {Shape{33, 97, 1536}, Shape{33, 5, 256}, Shape{17, 600, 512}}) {
        const int64_t K = is_k_quant(t) ? s.K / 256 * 256 : s.K;
        const Problem p(t, s.M, s.N, K, 2024, 0, act);
        for (Isa isa : runnable_isas()) {
          const std::string what = describe(p, isa);
          const auto base = p.run(pool1, isa);
          for (ThreadPool* pool : pools) {
            expect_bits_equal(p.run(*pool, isa).data(), base.data(), int64_t(base.size()),
                              what + " batch, threads=" + std::to_string(pool->size()));
            // Every row alone.
            std::vector<float> row(static_cast<size_t>(p.ldo));
            for (int64_t m = 0; m < p.M; ++m) {
              matmul(p.args(row.data(), m, 1), *pool, isa);
              expect_bits_equal(row.data(), base.data() + m * p.ldo, p.N,
                                what + " row " + std::to_string(m) + " alone");
            }
            // A middle slice of rows and a shifted window of weight rows.
            const int64_t r0 = 5, rows = 7, n0 = 3, n = p.N - 3;
            std::vector<float> part(static_cast<size_t>(rows * p.ldo));
            matmul(p.args(part.data(), r0, rows), *pool, isa);
            for (int64_t m = 0; m < rows; ++m)
              expect_bits_equal(part.data() + m * p.ldo, base.data() + (r0 + m) * p.ldo, p.N,
                                what + " rows 5..11");
            if (n > 0) {
              matmul(p.args(part.data(), r0, rows, n0, n), *pool, isa);
              for (int64_t m = 0; m < rows; ++m)
                expect_bits_equal(part.data() + m * p.ldo, base.data() + (r0 + m) * p.ldo + n0, n,
                                  what + " weight rows from 3");
            }
          }
        }
      }
}

// Each ISA stores the quantized activations in its own layout; decoded, every value must
// be exactly what the scalar quantizer (llama.cpp's SIMD rounding) makes.
TEST(Matmul, SimdActivationQuantizersMatchScalar) {
  const int64_t K = 800;
  std::mt19937 rng(17);
  auto x = random_floats(K, rng, 2.0f);
  x[0] = 127.0f;  // 127 / amax = 1: the rest of block 0 are exact .5 ties
  for (int i = 1; i < 32; ++i) x[size_t(i)] = float(i - 16) + 0.5f;
  for (int i = 32; i < 64; ++i) x[size_t(i)] = 0.0f;  // an all-zero block
  std::vector<ActBlock> want(size_t(K / 32));
  quantize_row_act(x.data(), want.data(), K);
  EXPECT_EQ(want[0].qs[1], -14);  // -14.5 rounds to even
  EXPECT_EQ(want[0].qs[2], -14);  // -13.5 too
  struct Layout {
    Isa isa;
    const detail::Kernels* k;
  };
  std::vector<Layout> layouts;
  if (isa_supported(Isa::Avx2)) layouts.push_back({Isa::Avx2, &detail::kernels_avx2()});
  if (isa_supported(Isa::Avx512Vnni))
    layouts.push_back({Isa::Avx512Vnni, &detail::kernels_avx512()});
  for (const Layout& l : layouts)
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
      const detail::Q8Layout lay = l.k->q8_layout(K);
      std::vector<uint8_t> row(lay.row_bytes + 64);
      auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(row.data()) + 63) &
                                              ~uintptr_t(63));
      l.k->quantize_q8(x.data(), K, t, base);
      const auto* d = reinterpret_cast<const float*>(base + lay.d_off);
      const auto* s = reinterpret_cast<const float*>(base + lay.s_off);
      for (int64_t b = 0; b < K / 32; ++b) {
        const ActBlock& w = want[size_t(b)];
        EXPECT_EQ(d[b], w.d) << isa_name(l.isa) << " block " << b;
        EXPECT_EQ(s[b], w.s) << isa_name(l.isa) << " block " << b;
        for (int e = 0; e < 32; ++e)
          ASSERT_EQ(int(int8_t(base[b * 32 + e])), int(w.qs[e]))
              << isa_name(l.isa) << " block " << b << " element " << e;
        if (l.isa == Isa::Avx512Vnni && t != DType::Q4_1) {
          // Lane corrections that undo the weights' offset: -8 (Q4_0) or -128 (Q8_0) times
          // the sums of four activations.
          const int offset = t == DType::Q4_0 ? 8 : 128;
          for (int u = 0; u < 8; ++u) {
            int32_t c;
            std::memcpy(&c, base + lay.c_off + b * 32 + 4 * u, 4);
            int sum = 0;
            for (int e = 4 * u; e < 4 * u + 4; ++e) sum += w.qs[e];
            ASSERT_EQ(c, -offset * sum) << "block " << b << " lane " << u;
          }
        }
      }
    }
}

TEST(Matmul, RejectsUnsupportedTypesAndIsas) {
  ThreadPool pool(1);
  EXPECT_FALSE(matmul_supports(DType::Q2_K));
  EXPECT_TRUE(matmul_supports(DType::Q4_1));
  EXPECT_TRUE(matmul_supports(DType::Q4_1, ActPrecision::Q8));
  EXPECT_TRUE(matmul_supports(DType::Q5_K));  // precise mode only
  EXPECT_FALSE(matmul_supports(DType::Q5_K, ActPrecision::Q8));
  const Problem p(DType::F32, 2, 3, 64, 5);
  std::vector<float> out(6);
  MatmulArgs a = p.args(out.data());
  a.wtype = DType::Q2_K;
  EXPECT_THROW(matmul(a, pool, Isa::Scalar), UnsupportedError);
  a.wtype = DType::Q5_0;
  a.w_row_bytes = dtype_bytes(DType::Q5_0, 64);
  a.act = ActPrecision::Q8;
  EXPECT_THROW(matmul(a, pool, Isa::Scalar), UnsupportedError);
  if (!isa_supported(Isa::Amx)) {
    EXPECT_THROW(matmul(p.args(out.data()), pool, Isa::Amx), Error);
  }
  a = p.args(out.data());
  a.w_row_bytes = 8;  // shorter than a row
  EXPECT_THROW(matmul(a, pool, Isa::Scalar), Error);
  MatmulArgs k = Problem(DType::Q4_K, 1, 1, 256, 6).args(out.data());
  k.K = 288;  // not a whole super-block
  k.w_row_bytes = 1024;
  EXPECT_THROW(matmul(k, pool, detect_isa()), Error);
}

TEST(Matmul, EmptyShapesAreNoOps) {
  ThreadPool pool(2);
  const Problem p(DType::Q4_0, 1, 4, 64, 8);
  std::vector<float> out(4, 7.0f);
  EXPECT_NO_THROW(matmul(p.args(out.data(), 0, 0), pool, detect_isa()));
  EXPECT_NO_THROW(matmul(p.args(out.data(), 0, 1, 0, 0), pool, detect_isa()));
  EXPECT_EQ(out[0], 7.0f);
}

}  // namespace
}  // namespace ds::cpu
