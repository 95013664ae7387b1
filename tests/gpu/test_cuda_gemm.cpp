// CUDA matmul and batched_matmul (cuBLAS, or the skinny kernel for small M) against float64
// references and the CPU backend, for F32, F16 and BF16 weights, awkward shapes and strided /
// permuted views.
//
// Tolerances. The cuBLAS path rounds x to the weights' dtype (unit roundoff u16: 2^-11 for
// F16, 2^-8 for BF16, 0 for F32 weights); the skinny kernel
// (small M, aligned rows; see use_skinny_gemm) uses x as given. Both accumulate in F32 (u32 =
// 2^-24). For out[m, n] with S = sum_k |x[m,k] w[n,k]|:
//  - against float64 math on the x its path uses only the F32 accumulation differs. IEEE F32
//    sums in any order stay within (K - 1) u32 S; tensor cores align and truncate instead of
//    rounding (Fasi et al. 2021, "Numerical behavior of NVIDIA tensor cores"), up to twice
//    that, so the bound is 4 K u32 S (kAccum), with margin;
//  - against exact x (float64 on the unrounded x) rounding x adds at most u16 S, since each
//    |x^ - x| <= u16 |x|; against the CPU backend its own F32 sum adds another K u32 S.
// The sqrt(K)-scaled estimates that typical errors follow would be tighter but can fail on an
// unlucky seed; these cannot, yet a wrong index, a dropped k term or an unrounded x (for K up to
// a few thousand) exceeds them.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/switches.h"
#include "gpu_test_util.h"

namespace ds {
namespace {

using test::BackendTensor;
using test::Twin;
using test::twin_floats;
using test::view_of;

double unit_roundoff(DType t) {
  switch (t) {
    case DType::F16:
      return 1.0 / (1 << 11);
    case DType::BF16:
      return 1.0 / (1 << 8);
    default:
      return 0.0;
  }
}
constexpr double kU32 = 1.0 / (1 << 24);
constexpr double kAccum = 4.0;  // GPU F32 accumulation: kAccum * K * u32 * S

// Whether the backend runs this (batched_)matmul on the skinny kernel (x as given) rather than
// cuBLAS (x rounded to w's dtype).
bool skinny_path(const TensorView& x, const TensorView& w, const TensorView& out) {
  return cuda::use_skinny_gemm(x.ndim == 3 ? cuda::skinny_batched_args(x, w, out)
                                           : cuda::skinny_matmul_args(x, w, out));
}

// x [B][M, K] and w [B][N, K] as dense host arrays (values the GPU sees for w).
struct Reference {
  std::vector<double> exact, rounded;  // [B, M, N]: with x as given / rounded to w's dtype
  std::vector<double> abs_sum;         // [B, M, N]: sum_k |x w|
};

Reference reference(const std::vector<float>& x, const std::vector<float>& w, DType wtype,
                    int64_t b, int64_t m, int64_t n, int64_t k) {
  Reference r;
  r.exact.resize(size_t(b * m * n));
  r.rounded.resize(r.exact.size());
  r.abs_sum.resize(r.exact.size());
  for (int64_t bb = 0; bb < b; ++bb)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double e = 0, q = 0, s = 0;
        for (int64_t t = 0; t < k; ++t) {
          const double xv = x[size_t((bb * m + i) * k + t)];
          const double xr = test::round_to(wtype, float(xv));
          const double wv = w[size_t((bb * n + j) * k + t)];
          e += xv * wv;
          q += xr * wv;
          s += std::abs(xv * wv);
        }
        const size_t o = size_t((bb * m + i) * n + j);
        r.exact[o] = e;
        r.rounded[o] = q;
        r.abs_sum[o] = s;
      }
  return r;
}

// Checks the whole output buffer: the view's elements against want within factor * abs_sum
// (+ a tiny floor), everything else (padding) unchanged from `initial`.
::testing::AssertionResult check_output(const std::vector<float>& got_buffer,
                                        const std::vector<float>& initial, const void* base,
                                        const TensorView& out_view, const std::vector<double>& want,
                                        const std::vector<double>& abs_sum, double factor,
                                        const std::string& what,
                                        const std::vector<int64_t>& buffer_dims) {
  std::vector<double> full(initial.begin(), initial.end());
  std::vector<double> bound(full.size(), 0.0);
  const std::vector<size_t> idx = test::view_offsets(base, out_view);
  for (size_t i = 0; i < idx.size(); ++i) {
    full[idx[i]] = want[i];
    bound[idx[i]] = factor * abs_sum[i] + 1e-30;
  }
  return test::all_close_bounds(got_buffer, full, bound, what, buffer_dims);
}

TEST(CudaGemm, MatmulMatchesReferenceAndCpu) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int64_t m, k, n;
  };
  const Case cases[] = {{1, 7, 1},       {7, 64, 97},    {97, 576, 7}, {1000, 97, 64},
                        {1, 2048, 1000}, {97, 1000, 97}, {7, 13, 1000}};
  uint32_t seed = 1000;
  for (DType wt : {DType::F32, DType::F16, DType::BF16}) {
    for (const Case& cs : cases) {
      const int64_t m = cs.m, k = cs.k, n = cs.n;
      SCOPED_TRACE(std::string(dtype_name(wt)) + " M " + std::to_string(m) + " K " +
                   std::to_string(k) + " N " + std::to_string(n));
      const int64_t ldx = k + 5, ldw = k + 8, ldo = n + 3;
      // w is rows [1, n + 1) of a bigger padded matrix, as a slice of a fused weight would be.
      const std::vector<float> xb = test::random_floats(size_t(m * ldx), ++seed);
      const std::vector<float> wb =
          test::round_to(wt, test::random_floats(size_t((n + 2) * ldw), ++seed));
      const Twin xt = twin_floats(DType::F32, {m, ldx}, xb);
      const Twin wtw = twin_floats(wt, {n + 2, ldw}, wb);
      const std::vector<float> init = test::random_floats(size_t(m * ldo), ++seed, 50, 60);
      const Twin out = twin_floats(DType::F32, {m, ldo}, init);
      const TensorView xv_g = view_of(xt.gpu, {m, k}, {ldx, 1}),
                       wv_g = view_of(wtw.gpu, {n, k}, {ldw, 1}, ldw),
                       ov_g = view_of(out.gpu, {m, n}, {ldo, 1});
      g.matmul(xv_g, wv_g, ov_g);
      std::vector<float> x(size_t(m * k)), w(size_t(n * k));
      for (int64_t i = 0; i < m; ++i)
        for (int64_t t = 0; t < k; ++t) x[size_t(i * k + t)] = xb[size_t(i * ldx + t)];
      for (int64_t j = 0; j < n; ++j)
        for (int64_t t = 0; t < k; ++t) w[size_t(j * k + t)] = wb[size_t((j + 1) * ldw + t)];
      const Reference r = reference(x, w, wt, 1, m, n, k);
      const std::vector<float> got = test::download_floats(g, out.gpu);
      const std::vector<int64_t> bd = {m, ldo};
      const bool skinny = skinny_path(xv_g, wv_g, ov_g);
      EXPECT_TRUE(check_output(
          got, init, out.gpu.view.data, ov_g, skinny ? r.exact : r.rounded, r.abs_sum,
          kAccum * double(k) * kU32,
          skinny ? "matmul (skinny) vs float64" : "matmul vs float64 on rounded x", bd));
      const double u16 = unit_roundoff(wt);
      EXPECT_TRUE(check_output(got, init, out.gpu.view.data, ov_g, r.exact, r.abs_sum,
                               u16 + kAccum * double(k) * kU32, "matmul vs float64", bd));
      // The CPU backend on the same views: exact x, its own F32 sums.
      c.matmul(view_of(xt.cpu, {m, k}, {ldx, 1}), view_of(wtw.cpu, {n, k}, {ldw, 1}, ldw),
               view_of(out.cpu, {m, n}, {ldo, 1}));
      const std::vector<float> cpu = test::download_floats(c, out.cpu);
      std::vector<double> cpu_view;
      for (size_t i : test::view_offsets(out.cpu.view.data, view_of(out.cpu, {m, n}, {ldo, 1})))
        cpu_view.push_back(cpu[i]);
      EXPECT_TRUE(check_output(got, init, out.gpu.view.data, ov_g, cpu_view, r.abs_sum,
                               u16 + (kAccum + 1.0) * double(k) * kU32, "matmul vs cpu", bd));
    }
  }
}

TEST(CudaGemm, BatchedMatmulOverPermutedViews) {
  DS_REQUIRE_GPU();
  Backend &g = test::cuda_backend(), &c = test::cpu_backend();
  struct Case {
    int64_t b, m, k, n;
    bool permuted_x, permuted_out, padded_w;
  };
  const Case cases[] = {
      {1, 1, 7, 1, false, false, false},
      {3, 7, 64, 97, true, true, false},
      {16, 97, 128, 512, true, true, true},  // DeepSeek's q_nope . W_UK over heads
      {16, 1, 512, 128, true, true, false},  // latent . W_UV, one decode token
      {5, 1000, 7, 3, false, false, true},
      {2, 13, 9, 1, true, false, true},
      // 128 heads (DeepSeek-V2.5), 8 decode tokens: BF16 weights past the skinny kernel's
      // range run the dense wq kernel with the batch's row blocks side by side (W_UK: one
      // 128-k group a product; W_UV: four, split over a cluster).
      {128, 8, 128, 512, true, true, false},
      {128, 8, 512, 128, true, true, true},
  };
  struct Restore {
    ~Restore() { cuda::g_wq_cluster.force(-1); }
  } restore;
  int on_wq_kernel = 0;
  uint32_t seed = 2000;
  for (DType wt : {DType::F32, DType::F16, DType::BF16}) {
    for (const Case& cs : cases) {
      const int64_t b = cs.b, m = cs.m, k = cs.k, n = cs.n;
      SCOPED_TRACE(std::string(dtype_name(wt)) + " B " + std::to_string(b) + " M " +
                   std::to_string(m) + " K " + std::to_string(k) + " N " + std::to_string(n) +
                   (cs.permuted_x ? " x[T,H,d]" : "") + (cs.permuted_out ? " out[T,H,d]" : ""));
      // x: a [M, B, K] buffer viewed as {B, M, K} (heads of a [T, H, d] activation), or
      // [B, M, K + 2] with padded rows.
      const int64_t ldx = cs.permuted_x ? k : k + 2;
      const std::vector<float> xb = test::random_floats(size_t(b * m * ldx), ++seed);
      const Twin xt = twin_floats(DType::F32, {int64_t(xb.size())}, xb);
      const std::vector<int64_t> x_strides =
          cs.permuted_x ? std::vector<int64_t>{k, b * k, 1} : std::vector<int64_t>{m * ldx, ldx, 1};
      const TensorView xv = view_of(xt.gpu, {b, m, k}, x_strides);
      const int64_t ldw = cs.padded_w ? k + 8 : k;
      const std::vector<float> wb =
          test::round_to(wt, test::random_floats(size_t(b * n * ldw), ++seed));
      const Twin wtw = twin_floats(wt, {int64_t(wb.size())}, wb);
      const TensorView wv = view_of(wtw.gpu, {b, n, k}, {n * ldw, ldw, 1});
      const std::vector<int64_t> o_strides =
          cs.permuted_out ? std::vector<int64_t>{n, b * n, 1} : std::vector<int64_t>{m * n, n, 1};
      const std::vector<float> init = test::random_floats(size_t(b * m * n), ++seed, 50, 60);
      const Twin out = twin_floats(DType::F32, {int64_t(init.size())}, init);
      const TensorView ov = view_of(out.gpu, {b, m, n}, o_strides);
      g.batched_matmul(xv, wv, ov);
      std::vector<float> x(size_t(b * m * k)), w(size_t(b * n * k));
      for (int64_t bb = 0; bb < b; ++bb) {
        for (int64_t i = 0; i < m; ++i)
          for (int64_t t = 0; t < k; ++t)
            x[size_t((bb * m + i) * k + t)] = xb[size_t(bb * x_strides[0] + i * x_strides[1] + t)];
        for (int64_t j = 0; j < n; ++j)
          for (int64_t t = 0; t < k; ++t)
            w[size_t((bb * n + j) * k + t)] = wb[size_t((bb * n + j) * ldw + t)];
      }
      const Reference r = reference(x, w, wt, b, m, n, k);
      const std::vector<float> got = test::download_floats(g, out.gpu);
      const std::vector<int64_t> bd = {int64_t(init.size())};
      const bool skinny = skinny_path(xv, wv, ov);
      EXPECT_TRUE(check_output(
          got, init, out.gpu.view.data, ov, skinny ? r.exact : r.rounded, r.abs_sum,
          kAccum * double(k) * kU32,
          skinny ? "batched_matmul (skinny) vs float64" : "batched_matmul vs float64 on rounded x",
          bd));
      EXPECT_TRUE(check_output(got, init, out.gpu.view.data, ov, r.exact, r.abs_sum,
                               unit_roundoff(wt) + kAccum * double(k) * kU32,
                               "batched_matmul vs float64", bd));
      if (!skinny && cuda::wq_batched_fits(xv, wv, ov)) {
        // Without clusters the products keep K whole (no partials buffer per batch entry).
        ++on_wq_kernel;
        cuda::g_wq_cluster.force(0);
        g.upload(out.gpu.view, init.data(), init.size() * 4);
        g.batched_matmul(xv, wv, ov);
        cuda::g_wq_cluster.force(-1);
        EXPECT_TRUE(check_output(test::download_floats(g, out.gpu), init, out.gpu.view.data, ov,
                                 r.rounded, r.abs_sum, kAccum * double(k) * kU32,
                                 "batched_matmul (wq kernel, no cluster) vs float64 on rounded x",
                                 bd));
      }
      if (!c.supports(Op::BatchedMatMul, wt)) continue;
      const TensorView ov_c = view_of(out.cpu, {b, m, n}, o_strides);
      c.batched_matmul(view_of(xt.cpu, {b, m, k}, x_strides),
                       view_of(wtw.cpu, {b, n, k}, {n * ldw, ldw, 1}), ov_c);
      const std::vector<float> cpu = test::download_floats(c, out.cpu);
      std::vector<double> cpu_view;
      for (size_t i : test::view_offsets(out.cpu.view.data, ov_c)) cpu_view.push_back(cpu[i]);
      EXPECT_TRUE(check_output(got, init, out.gpu.view.data, ov, cpu_view, r.abs_sum,
                               unit_roundoff(wt) + (kAccum + 1.0) * double(k) * kU32,
                               "batched_matmul vs cpu", bd));
    }
  }
  EXPECT_EQ(on_wq_kernel, 2) << "the 128-head BF16 cases take the wq kernel";
}

// Which batched products the backend sends to the dense wq kernel (host only: no GPU memory is
// touched). MLA's absorbed products at 128 heads and 8 decode tokens, x and out heads-first
// views of [T, H, d] activations, take it; more tokens, K not whole 16-byte BF16 chunks,
// another weight type, or an x the kernel's 16-byte copies cannot read do not. Their K splits:
// W_UV (K 512, 128 heads of 128 rows) two per tile, W_UK (K 128) none.
TEST(WqBatchedPlan, TakesTheDecodeViewsOnly) {
  struct Restore {
    ~Restore() { cuda::g_wq_stage_f32.force(-1); }
  } restore;
  alignas(16) static uint8_t buf[64];
  const int64_t H = 128, T = 8;
  // x {H, T, k} over [T, H, ldx] F32; w [H, n, k] of `wt`; out {H, T, n} over [T, H, n].
  const auto views = [&](int64_t t, int64_t k, int64_t n, int64_t ldx, DType wt, int64_t x_offset) {
    const TensorView base = test::make_view(buf, DType::F32, {1});
    TensorView wbase = test::make_view(buf, wt, {1});
    const int64_t we = int64_t(test::element_bytes(wt));
    return std::array<TensorView, 3>{
        test::strided_view(base, {H, t, k}, {ldx * 4, H * ldx * 4, 4}, x_offset),
        test::strided_view(wbase, {H, n, k}, {n * k * we, k * we, we}),
        test::strided_view(base, {H, t, n}, {n * 4, H * n * 4, 4})};
  };
  const auto fits = [](const std::array<TensorView, 3>& v) {
    return cuda::wq_batched_fits(v[0], v[1], v[2]);
  };
  EXPECT_TRUE(fits(views(T, 128, 512, 128, DType::BF16, 0)));  // q_nope . W_UK
  EXPECT_TRUE(fits(views(T, 512, 128, 512, DType::BF16, 0)));  // latent . W_UV
  EXPECT_TRUE(fits(views(1, 512, 128, 512, DType::BF16, 0)));
  EXPECT_FALSE(fits(views(9, 512, 128, 512, DType::BF16, 0)));  // 9 tokens
  EXPECT_FALSE(fits(views(T, 100, 128, 100, DType::BF16, 0)));  // K: 200 bytes a row
  EXPECT_FALSE(fits(views(T, 512, 128, 512, DType::F16, 0)));   // F16 weights
  EXPECT_FALSE(fits(views(T, 512, 128, 512, DType::BF16, 4)));  // x off 16-byte alignment
  EXPECT_FALSE(fits(views(T, 512, 128, 514, DType::BF16, 0)));  // x rows 2056 bytes apart
  cuda::g_wq_stage_f32.force(0);  // no F32 staging: the batch has no conversion launch
  EXPECT_FALSE(fits(views(T, 128, 512, 128, DType::BF16, 0)));
  // Splits from the batch's row blocks side by side (132 SMs, 4 CTAs each).
  EXPECT_EQ(cuda::wq_split_groups(H * 128, 512, 132 * 4, 1), 2);  // W_UV: 4 groups, 2 splits
  EXPECT_EQ(cuda::wq_split_groups(H * 512, 128, 132 * 4, 1), 1);  // W_UK: one group
}

// The same row gives the same result whatever else is in the batch, within the F32 bound
// (M = 1 runs the skinny kernel on x as given, M = 256 cuBLAS on x rounded to w's dtype, so
// bit equality is not promised; tests/gpu/test_cuda_gemm_skinny.cpp checks it for small M).
TEST(CudaGemm, MatmulRowsDoNotDependOnTheBatch) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const int64_t k = 2048, n = 1024;
  for (DType wt : {DType::BF16, DType::F32}) {
    SCOPED_TRACE(std::string(dtype_name(wt)));
    const std::vector<float> x = test::random_floats(size_t(256 * k), 31);
    const BackendTensor xt = test::upload_floats(g, DType::F32, {256, k}, x);
    const BackendTensor w =
        test::upload_floats(g, wt, {n, k}, test::random_floats(size_t(n * k), 32));
    BackendTensor one = test::zeros(g, DType::F32, {1, n}),
                  many = test::zeros(g, DType::F32, {256, n});
    g.matmul(view_of(xt, {1, k}, {k, 1}), w.view, one.view);
    g.matmul(xt.view, w.view, many.view);
    const std::vector<float> a = test::download_floats(g, one),
                             all = test::download_floats(g, many);
    const std::vector<double> first_row(all.begin(), all.begin() + n);
    // Both are within kAccum K u32 S of their exact sums, which differ by at most u16 S (x
    // rounded or not); S <= K.
    EXPECT_TRUE(test::all_close(
        a, first_row, {(2.0 * kAccum * double(k) * kU32 + unit_roundoff(wt)) * double(k), 0.0},
        "row 0 alone vs in a batch of 256"));
  }
}

}  // namespace
}  // namespace ds
