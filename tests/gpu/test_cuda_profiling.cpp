// Timing marks on the CUDA backend (events on its stream) and the ProfilingBackend over it:
// marks resolve in order without the host waiting for the work between them, a big GEMM
// takes longer than a tiny add, and marks are refused inside a graph capture.
#include <gtest/gtest.h>

#include <chrono>

#include "backend/profiling_backend.h"
#include "gpu_test_util.h"

namespace ds {
namespace {

using test::cuda_backend;

// x [M, K] F32 and w [N, K] BF16 on the GPU, out [M, N].
struct BigGemm {
  test::BackendTensor x, w, out;
  BigGemm(Backend& b, int64_t M, int64_t N, int64_t K)
      : x(test::upload_floats(b, DType::F32, {M, K}, test::random_floats(size_t(M * K), 1))),
        w(test::upload_floats(b, DType::BF16, {N, K}, test::random_floats(size_t(N * K), 2))),
        out(test::zeros(b, DType::F32, {M, N})) {}
  void run(Backend& b) { b.matmul(x.view, w.view, out.view); }
};

TEST(CudaProfiling, MarksResolveInOrderWithoutWaiting) {
  DS_REQUIRE_GPU();
  Backend& gpu = cuda_backend();
  BigGemm g(gpu, 2048, 8192, 8192);
  g.run(gpu);  // warm-up: cuBLAS heuristics, first launch
  gpu.synchronize();
  gpu.clear_marks();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(gpu.mark(), 0);
  for (int i = 0; i < 10; ++i) {
    g.run(gpu);
    EXPECT_EQ(gpu.mark(), i + 1);
  }
  const double issue_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const std::vector<double> t = gpu.mark_times_ms();
  ASSERT_EQ(t.size(), 11u);
  EXPECT_EQ(t[0], 0.0);
  for (size_t i = 1; i < t.size(); ++i) EXPECT_GT(t[i], t[i - 1]) << i;
  // Ten 275-GFLOP GEMMs take milliseconds on the device; issuing them and the marks must not
  // have waited for them.
  EXPECT_GT(t.back(), 1.0);
  EXPECT_LT(issue_ms, t.back() / 2) << "mark() waited for the stream";
  // Cleared marks are reused from the start.
  gpu.clear_marks();
  EXPECT_TRUE(gpu.mark_times_ms().empty());
  EXPECT_EQ(gpu.mark(), 0);
  gpu.clear_marks();
}

TEST(CudaProfiling, MarksAreRefusedDuringCapture) {
  DS_REQUIRE_GPU();
  Backend& gpu = cuda_backend();
  gpu.clear_marks();
  gpu.begin_capture();
  EXPECT_THROW(gpu.mark(), Error);
  gpu.end_capture();
  EXPECT_EQ(gpu.mark(), 0);  // and work again afterwards
  gpu.clear_marks();
}

TEST(CudaProfiling, ProfilerTimesABigGemmAboveATinyAdd) {
  DS_REQUIRE_GPU();
  Backend& gpu = cuda_backend();
  ProfilingBackend prof(gpu);
  EXPECT_FALSE(prof.supports_graphs());
  constexpr int64_t kVocab = 64, kHidden = 16, T = 2;
  auto table = test::upload_floats(gpu, DType::F32, {kVocab, kHidden},
                                   test::random_floats(size_t(kVocab * kHidden), 3));
  const std::vector<int32_t> ids_host = {5, 9};
  auto ids = test::upload_ints(gpu, ids_host);
  auto x = test::zeros(gpu, DType::F32, {T, kHidden});
  const std::vector<float> ones(size_t(T * kHidden), 1.0f);
  auto y = test::upload_floats(gpu, DType::F32, {T, kHidden}, ones);
  BigGemm g(gpu, 2048, 8192, 8192);
  g.run(gpu);
  gpu.synchronize();
  constexpr int kSteps = 3;
  for (int s = 0; s < kSteps; ++s) {
    prof.embed(table.view, ids.ptr<int32_t>(), int(T), x.view);  // a step starts here
    prof.add(x.view, y.view);
    g.run(prof);
  }
  const OpProfile p = prof.profile();
  ASSERT_TRUE(p.step);
  EXPECT_EQ(p.steps, kSteps);
  EXPECT_EQ(p.step->steps, kSteps);
  EXPECT_EQ(p.step->tokens, T);
  double add_us = -1, gemm_us = -1;
  for (const auto& r : p.step->ops) {
    EXPECT_EQ(r.calls, 1) << r.label;
    EXPECT_GE(r.us, 0) << r.label;
    if (r.label == "add [2,16]") add_us = r.us;
    if (r.label == "matmul [2048,8192]x[8192,8192] BF16") gemm_us = r.us;
  }
  ASSERT_GE(add_us, 0);
  ASSERT_GE(gemm_us, 0);
  EXPECT_GT(gemm_us, 10 * add_us) << "gemm " << gemm_us << " us, add " << add_us << " us";
  EXPECT_GT(gemm_us, 50);  // 275 GFLOP cannot run in under 50 us
  EXPECT_LE(p.step->op_ms, p.step->wall_ms + 1e-6);
  EXPECT_EQ(p.step->ops.front().label, "matmul [2048,8192]x[8192,8192] BF16");
  // The forwarded ops computed: x = table[ids] + 1 after the last step.
  const std::vector<float> got = test::download_floats(gpu, x);
  const std::vector<float> tab = test::download_floats(gpu, table);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < kHidden; ++i)
      EXPECT_FLOAT_EQ(got[size_t(t * kHidden + i)],
                      tab[size_t(ids_host[size_t(t)] * kHidden + i)] + 1)
          << t << "," << i;
}

}  // namespace
}  // namespace ds
