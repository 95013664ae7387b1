// The skinny GEMM's launch plan and kernel body on the host (skinny_gemm_sim.h), no GPU
// needed: every weight row and K chunk is covered once, results match float64 within the F32
// bound, rows are batch-invariant bit for bit, and the launcher's eligibility test rejects
// what the kernel cannot load.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "skinny_gemm_sim.h"

namespace ds {
namespace {

namespace sk = cuda::skinny;
using skinny_sim::Problem;
using skinny_sim::Spec;

std::string spec_str(const Spec& s, int sm) {
  return std::string(dtype_name(s.wt)) + " B " + std::to_string(s.batch) + " M " +
         std::to_string(s.m) + " N " + std::to_string(s.n) + " K " + std::to_string(s.k) +
         (s.permuted ? " heads-first" : "") + " sm " + std::to_string(sm);
}

// Every (unit, chunk) pair is owned by exactly one (CTA, round, warp); k groups depend on
// N, K, batch and SMs only.
TEST(SkinnyGemmPlan, CoversEveryRowAndChunkOnce) {
  for (bool one_wave : {false, true})
    for (int sm : {1, 7, 132}) {
      for (int64_t n : {1, 3, 4, 5, 64, 576, 3072, 102400}) {
        for (int64_t k : {8, 120, 512, 2048, 10944}) {
          for (int es : {2, 4}) {
            for (int64_t batch : {1, 16}) {
              if (k * es % 16 != 0) continue;
              SCOPED_TRACE(std::string(one_wave ? "one wave, " : "") + "sm " + std::to_string(sm) +
                           " N " + std::to_string(n) + " K " + std::to_string(k) + " esize " +
                           std::to_string(es) + " B " + std::to_string(batch));
              const sk::Plan p1 = sk::make_plan(batch, 1, n, k, es, sm, one_wave);
              for (int64_t m : {1, 2, 3, 8, 16, 17, 64}) {
                const sk::Plan p = sk::make_plan(batch, m, n, k, es, sm, one_wave);
                ASSERT_EQ(p.chunks, p1.chunks);
                ASSERT_EQ(p.k_groups, p1.k_groups);
                ASSERT_EQ(p.slice, p1.slice);
                ASSERT_EQ(p.row_groups * p.k_groups, sk::kWarps);
                ASSERT_TRUE(p.tm >= 1 && p.tm <= sk::kMaxTm && (p.tm >= m || p.tm == sk::kMaxTm));
                ASSERT_EQ(p.chunks * 16, k * es);
                std::vector<int> unit_seen(size_t(p.units), 0);
                for (int64_t cta = 0; cta < p.ctas; ++cta) {
                  ASSERT_LT(sk::unit_of(p, cta, 0, 0), p.units) << "a CTA without work";
                  for (int round = 0; round < p.rounds; ++round) {
                    for (int rg = 0; rg < p.row_groups; ++rg) {
                      const int64_t u = sk::unit_of(p, cta, round, rg);
                      if (u < p.units) ++unit_seen[size_t(u)];
                    }
                  }
                }
                for (int64_t u = 0; u < p.units; ++u) ASSERT_EQ(unit_seen[size_t(u)], 1) << u;
                std::vector<int> chunk_seen(size_t(p.chunks), 0);
                for (int warp = 0; warp < sk::kWarps; ++warp) {
                  const sk::WarpJob j = sk::warp_job(p, warp);
                  ASSERT_EQ(j.rg * p.k_groups + j.kg, warp);
                  if (j.rg != 0) continue;
                  ASSERT_LE(j.c_begin, j.c_end);
                  for (int c = j.c_begin; c < j.c_end; ++c) ++chunk_seen[size_t(c)];
                }
                for (int c = 0; c < p.chunks; ++c) ASSERT_EQ(chunk_seen[size_t(c)], 1) << c;
              }
            }
          }
        }
      }
    }
}

// DeepSeek-V2-Lite's short projections spread K over the warps of a CTA so the grid covers
// an H200's 132 SMs.
TEST(SkinnyGemmPlan, ShortProjectionsSplitK) {
  const sk::Plan kv_a = sk::make_plan(1, 1, 576, 2048, 2, 132);
  EXPECT_EQ(kv_a.k_groups, 8);
  EXPECT_EQ(kv_a.ctas, 144);
  const sk::Plan router = sk::make_plan(1, 1, 64, 2048, 4, 132);
  EXPECT_EQ(router.k_groups, 8);
  const sk::Plan lm_head = sk::make_plan(1, 1, 102400, 2048, 2, 132);
  EXPECT_EQ(lm_head.k_groups, 1);
  EXPECT_GE(lm_head.ctas, 264);
}

// DEEPSERVE_SKINNY_ONE_WAVE: W3's decode products in one wave of CTAs on an H200's 132 SMs, K
// split as far as that allows: o_proj (2048 x 2048) in 128 CTAs of two k groups (the default:
// 512 CTAs of eight), q with kv_a (3648 x 2048) in 114 of one (the default: 456 of four), kv_a
// alone in 72 of four; the router and lm_head as by default.
TEST(SkinnyGemmPlan, OneWaveFitsTheGridToTheSms) {
  const sk::Plan o = sk::make_plan(1, 1, 2048, 2048, 2, 132, true);
  EXPECT_EQ(o.k_groups, 2);
  EXPECT_EQ(o.ctas, 128);
  EXPECT_EQ(sk::make_plan(1, 1, 2048, 2048, 2, 132).ctas, 512);
  const sk::Plan q = sk::make_plan(1, 1, 3648, 2048, 2, 132, true);
  EXPECT_EQ(q.k_groups, 1);
  EXPECT_EQ(q.ctas, 114);
  EXPECT_EQ(sk::make_plan(1, 1, 3648, 2048, 2, 132).ctas, 456);
  const sk::Plan kv_a = sk::make_plan(1, 1, 576, 2048, 2, 132, true);
  EXPECT_EQ(kv_a.k_groups, 4);
  EXPECT_EQ(kv_a.ctas, 72);
  EXPECT_EQ(sk::make_plan(1, 1, 64, 2048, 4, 132, true).k_groups, 8);
  const sk::Plan lm_head = sk::make_plan(1, 1, 102400, 2048, 2, 132, true);
  EXPECT_EQ(lm_head.k_groups, 1);
  EXPECT_EQ(lm_head.ctas, sk::make_plan(1, 1, 102400, 2048, 2, 132).ctas);
  // Eight tokens: the same K split (batch invariance), one unit a row group (no rounds merged
  // past one wave).
  const sk::Plan o8 = sk::make_plan(1, 8, 2048, 2048, 2, 132, true);
  EXPECT_EQ(o8.k_groups, 2);
  EXPECT_EQ(o8.ctas, 128);
}

TEST(SkinnyGemmFits, NeedsWholeChunksAndAlignedRows) {
  alignas(16) static float buf[1024];
  const auto base = [&] {
    cuda::SkinnyGemmArgs a;
    a.wtype = DType::BF16;
    a.m = 2;
    a.n = 2;
    a.k = 16;
    a.x = buf;
    a.x_row = 64;
    a.w = buf;
    a.w_row = 32;
    a.out = buf;
    a.out_row = 8;
    return a;
  };
  EXPECT_TRUE(cuda::skinny_gemm_fits(base()));
  auto a = base();
  a.k = 12;  // 24 bytes: not whole chunks
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a = base();
  a.wtype = DType::F32;
  a.k = 6;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a = base();
  a.wtype = DType::Q8_0;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a = base();
  a.x = buf + 1;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a = base();
  a.w = reinterpret_cast<const uint8_t*>(buf) + 8;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a = base();
  a.x_row = 68;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a.m = 1;  // one row: its stride is never used
  EXPECT_TRUE(cuda::skinny_gemm_fits(a));
  a = base();
  a.w_row = 40;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a.n = 1;
  EXPECT_TRUE(cuda::skinny_gemm_fits(a));
  a = base();
  a.out_row = 6;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a = base();
  a.batch = 2;
  a.x_batch = 8;
  a.w_batch = 64;
  a.out_batch = 16;
  EXPECT_FALSE(cuda::skinny_gemm_fits(a));
  a.x_batch = 256;
  EXPECT_TRUE(cuda::skinny_gemm_fits(a));
}

TEST(SkinnyGemmSim, MatchesFloat64) {
  std::vector<Spec> specs;
  for (DType wt : {DType::BF16, DType::F16, DType::F32}) {
    for (int64_t m : {1, 2, 3, 5, 8, 9, 16, 17})
      specs.push_back({wt, 1, m, 13, 120, 4, 8, 3, 1, false});
    specs.push_back({wt, 1, 1, 1, 8, 0, 0, 0, 0, false});
    specs.push_back({wt, 1, 3, 3, 8, 4, 8, 1, 2, false});
    specs.push_back({wt, 1, 2, 576, 2048, 4, 8, 3, 1, false});
    specs.push_back({wt, 1, 4, 64, 10944, 0, 0, 0, 0, false});
    specs.push_back({wt, 1, 7, 66, 512, 8, 16, 2, 0, false});
    specs.push_back({wt, 3, 5, 17, 128, 4, 8, 1, 1, false});
    specs.push_back({wt, 4, 3, 40, 128, 0, 0, 0, 0, true});
    specs.push_back({wt, 2, 2, 9, 512, 4, 0, 3, 0, true});
  }
  uint32_t seed = 1;
  for (const Spec& s : specs) {
    const Problem p = skinny_sim::make_problem(s, ++seed);
    const skinny_sim::Expected e = skinny_sim::expected(p);
    std::vector<double> bound(e.abs_sum.size());
    for (size_t i = 0; i < bound.size(); ++i)
      bound[i] = skinny_sim::f32_bound_factor(s.k) * e.abs_sum[i];
    for (int sm : {132, 5, 1}) {
      SCOPED_TRACE(spec_str(s, sm));
      const std::vector<float> got = skinny_sim::simulate(p, sm);
      EXPECT_TRUE(test::all_close_bounds(got, e.want, bound, "simulated skinny GEMM vs float64"));
    }
  }
}

// Row i of x gives the same bits alone (M = 1) as inside any M (the K split and each lane's
// order do not depend on M), for every way of cutting the problem.
TEST(SkinnyGemmSim, RowsAreBatchInvariant) {
  for (DType wt : {DType::BF16, DType::F32}) {
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{576, 2048}, {64, 2048}, {37, 240}}) {
      for (int sm : {132, 3}) {
        const Spec big{wt, 1, 17, n, k, 4, 8, 1, 0, false};
        const Problem pb = skinny_sim::make_problem(big, 77);
        const std::vector<float> all = skinny_sim::simulate(pb, sm);
        for (int64_t m : {1, 3, 8, 16}) {
          SCOPED_TRACE(spec_str(big, sm) + " vs M " + std::to_string(m));
          // The first m rows of the same buffers, as a smaller problem.
          Problem ps = pb;
          ps.s.m = m;
          std::vector<float> part = ps.out0;
          skinny_sim::run(ps.args(ps.x.data(), ps.w.data(), part.data()), sm);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
              ASSERT_EQ(part[pb.out_index(0, i, j)], all[pb.out_index(0, i, j)])
                  << "row " << i << " col " << j;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ds
