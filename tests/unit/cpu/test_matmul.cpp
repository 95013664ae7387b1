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
                        DType::Q4_1, DType::Q8_0, DType::Q4_K, DType::Q6_K};

std::vector<Isa> runnable_isas() {
  std::vector<Isa> v;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx})
    if (isa_supported(isa)) v.push_back(isa);
  return v;
}

bool is_k_quant(DType t) {
  return t == DType::Q4_K || t == DType::Q6_K;
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
    if (!is_k_quant(t)) {
      const auto f = random_floats(K, rng, 0.1f);
      quantize_row(t, f.data(), row, K);
      continue;
    }
    // No K-quant quantizer: random bits with sane fp16 scales.
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> scale(-0.01f, 0.01f);
    const size_t bytes = dtype_bytes(t, K), bs = size_t(dtype_info(t).type_size);
    for (size_t i = 0; i < bytes; ++i) row[i] = uint8_t(byte(rng));
    for (size_t b = 0; b < bytes / bs; ++b) {
      uint8_t* blk = row + b * bs;
      for (size_t off : t == DType::Q4_K ? std::vector<size_t>{0, 2} : std::vector<size_t>{208}) {
        const uint16_t h = f32_to_fp16(scale(rng));
        std::memcpy(blk + off, &h, 2);
      }
    }
  }
  return w;
}

// The activations the kernels actually multiply: quantized then dequantized for block types.
std::vector<float> effective_x(DType t, const std::vector<float>& x, int64_t M, int64_t K,
                               int64_t ldx) {
  std::vector<float> out(static_cast<size_t>(M * K));
  const DType act = is_k_quant(t) ? DType::Q8_K : DType::Q8_0;
  std::vector<uint8_t> buf(dtype_bytes(act, K));
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x.data() + m * ldx;
    if (!dtype_info(t).quantized) {
      std::memcpy(out.data() + m * K, src, size_t(K) * 4);
    } else {
      quantize_row(act, src, buf.data(), K);
      dequantize_row(act, buf.data(), out.data() + m * K, K);
    }
  }
  return out;
}

struct Problem {
  DType t;
  int64_t M, N, K, ldx, ldo;
  size_t row_bytes;
  std::vector<float> x;
  std::vector<uint8_t> w;

  Problem(DType type, int64_t m, int64_t n, int64_t k, uint32_t seed, int64_t pad = 0)
      : t(type), M(m), N(n), K(k), ldx(k + pad), ldo(n + pad) {
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
    return a;
  }

  std::vector<float> run(ThreadPool& pool, Isa isa) const {
    std::vector<float> out(size_t(M * ldo), NAN);
    matmul(args(out.data()), pool, isa);
    return out;
  }
};

std::string describe(const Problem& p, Isa isa) {
  return std::string(dtype_name(p.t)) + " " + std::string(isa_name(isa)) +
         " M=" + std::to_string(p.M) + " N=" + std::to_string(p.N) + " K=" + std::to_string(p.K);
}

// F64 sums over the dequantized operands, and sum |x w| as the scale of rounding errors.
struct Reference {
  std::vector<double> value, magnitude;  // [M, N]
};

Reference reference(const Problem& p) {
  const auto xe = effective_x(p.t, p.x, p.M, p.K, p.ldx);
  std::vector<float> wrow(static_cast<size_t>(p.K));
  Reference r;
  r.value.resize(size_t(p.M * p.N));
  r.magnitude.resize(size_t(p.M * p.N));
  for (int64_t n = 0; n < p.N; ++n) {
    dequantize_row(p.t, p.w.data() + size_t(n) * p.row_bytes, wrow.data(), p.K);
    for (int64_t m = 0; m < p.M; ++m) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < p.K; ++k) {
        const double v = double(xe[size_t(m * p.K + k)]) * double(wrow[size_t(k)]);
        s += v;
        a += std::fabs(v);
      }
      r.value[size_t(m * p.N + n)] = s;
      r.magnitude[size_t(m * p.N + n)] = a;
    }
  }
  return r;
}

TEST(Matmul, MatchesF64ReferenceOnAwkwardShapes) {
  ThreadPool pool(2);
  const auto isas = runnable_isas();
  uint32_t seed = 1;
  for (DType t : kTypes)
    for (int64_t K : {32, 256, 576, 800, 1536}) {  // 800: an odd number of blocks
      if (is_k_quant(t) && K % 256 != 0) continue;
      for (int64_t N : {1, 5, 64, 97, 576})
        for (int64_t M : {1, 3, 7, 16, 33}) {
          const Problem p(t, M, N, K, seed++, M == 7 ? 3 : 0);
          const Reference ref = reference(p);
          for (Isa isa : isas) {
            const auto out = p.run(pool, isa);
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 0; n < N; ++n) {
                const size_t i = size_t(m * N + n);
                ASSERT_NEAR(out[size_t(m * p.ldo + n)], ref.value[i], 1e-4 * ref.magnitude[i])
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
  for (DType t : kTypes) {
    const Problem p(t, 9, 37, 1536, 99);
    const Reference ref = reference(p);
    const auto want = p.run(pool, Isa::Scalar);
    for (Isa isa : runnable_isas()) {
      const auto got = p.run(pool, isa);
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-5 * ref.magnitude[i]) << describe(p, isa) << " at " << i;
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
    for (Shape s : {Shape{33, 97, 1536}, Shape{33, 5, 256}, Shape{17, 600, 512}}) {
      const int64_t K = is_k_quant(t) ? s.K / 256 * 256 : s.K;
      const Problem p(t, s.M, s.N, K, 2024);
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
// be exactly what the scalar quantizer (ggml's reference rounding) makes.
TEST(Matmul, SimdActivationQuantizersMatchScalar) {
  const int64_t K = 800;
  std::mt19937 rng(17);
  auto x = random_floats(K, rng, 2.0f);
  x[0] = 127.0f;  // d = 1: the rest of block 0 are exact .5 ties
  for (int i = 1; i < 32; ++i) x[size_t(i)] = float(i - 16) + 0.5f;
  for (int i = 32; i < 64; ++i) x[size_t(i)] = 0.0f;  // an all-zero block
  std::vector<ActBlock> want(size_t(K / 32));
  quantize_row_act(x.data(), want.data(), K);
  struct Layout {
    Isa isa;
    const detail::Kernels* k;
    bool pairs;  // AVX-512: block pairs dword-interleaved, q stored + 128
  };
  std::vector<Layout> layouts;
  if (isa_supported(Isa::Avx2)) layouts.push_back({Isa::Avx2, &detail::kernels_avx2(), false});
  if (isa_supported(Isa::Avx512Vnni))
    layouts.push_back({Isa::Avx512Vnni, &detail::kernels_avx512(), true});
  for (const Layout& l : layouts) {
    const detail::Q8Layout lay = l.k->q8_layout(K);
    std::vector<uint8_t> row(lay.row_bytes + 64);
    auto* base =
        reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(row.data()) + 63) & ~uintptr_t(63));
    l.k->quantize_q8(x.data(), K, base);
    const auto* d = reinterpret_cast<const float*>(base + lay.d_off);
    const auto* s = reinterpret_cast<const float*>(base + lay.s_off);
    for (int64_t b = 0; b < K / 32; ++b) {
      const ActBlock& w = want[size_t(b)];
      EXPECT_EQ(d[b], w.d) << isa_name(l.isa) << " block " << b;
      EXPECT_EQ(s[b], w.s) << isa_name(l.isa) << " block " << b;
      for (int e = 0; e < 32; ++e) {
        int q;
        if (l.pairs) {  // lane 2u + (b & 1) of pair b / 2 holds elements 4u..4u+3
          const int64_t at = (b / 2) * 64 + (2 * (e / 4) + (b & 1)) * 4 + e % 4;
          q = int(base[at]) - 128;
        } else {
          q = int(int8_t(base[b * 32 + e]));
        }
        ASSERT_EQ(q, int(w.qs[e])) << isa_name(l.isa) << " block " << b << " element " << e;
      }
    }
  }
}

TEST(Matmul, RejectsUnsupportedTypesAndIsas) {
  ThreadPool pool(1);
  EXPECT_FALSE(matmul_supports(DType::Q5_0));
  EXPECT_TRUE(matmul_supports(DType::Q4_1));
  const Problem p(DType::F32, 2, 3, 64, 5);
  std::vector<float> out(6);
  MatmulArgs a = p.args(out.data());
  a.wtype = DType::Q5_0;
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
