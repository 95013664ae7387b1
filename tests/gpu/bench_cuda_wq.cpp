// WqBench.* (disabled by default): the quantized-weight tensor-core kernels (gemm_wq.cu) through
// Backend::matmul and moe_ffn, W4A16 and FP8W, on DeepSeek-V2.5 shapes (hidden 5120, dense
// FFN 12288, 160 experts of 1536, top-6) and V2-Lite's experts (64 of 1408, FP8W only: W4A16
// needs F % 128 == 0). Prints us per call, TB/s of weight bytes read (distinct rows touched)
// and TFLOP/s. Up to 256 tokens the calls replay from a CUDA graph (no launch overhead).
//   deepserve_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='WqBench.*'
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <vector>

#include "wq_test_util.h"

#define WQ_CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

namespace ds {
namespace {

using test::cuda_backend;

// Microseconds per call(i), i < n: graph replay when `graph`, else eager.
double time_calls(int n, bool graph, int reps, const std::function<void(int)>& call) {
  Backend& be = cuda_backend();
  for (int i = 0; i < n; ++i) call(i);  // sizes the scratch, builds the expert tables
  be.synchronize();
  int g = -1;
  if (graph) {
    be.begin_capture();
    for (int i = 0; i < n; ++i) call(i);
    g = be.end_capture();
    be.replay(g);
    be.synchronize();
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) {
    if (graph)
      be.replay(g);
    else
      for (int i = 0; i < n; ++i) call(i);
  }
  be.synchronize();
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  if (graph) be.reset_graphs();
  return us / (double(reps) * n);
}

// WQBENCH_M (e.g. "1,8": the decode rows only): the M / T values the benchmarks time.
bool bench_m_on(int64_t m) {
  const char* list = std::getenv("WQBENCH_M");
  if (!list) return true;
  for (const char* p = list; *p;) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p) break;
    if (v == m) return true;
    p = *end == ',' ? end + 1 : end;
  }
  return false;
}
// WQBENCH_SHAPE (e.g. o_proj): only the dense shapes whose name holds it.
bool bench_shape_on(const char* name) {
  const char* want = std::getenv("WQBENCH_SHAPE");
  return !want || std::strstr(name, want) != nullptr;
}

// A weight of `t` filled on the device with a byte pattern (finite codes and scales).
test::BackendTensor pattern_weight(DType t, int64_t N, int64_t K) {
  Backend& be = cuda_backend();
  test::BackendTensor w;
  const size_t bytes = size_t(N * (t == DType::BF16 ? K * 2 : test::wq_row_stride(t, K)));
  w.buffer = be.alloc(bytes);
  cudaMemset(w.buffer->data(), 0x3c, bytes);
  w.view = TensorView::contiguous(w.buffer->data(), t, {N, K}, be.device());
  w.view.stride[0] = t == DType::BF16 ? K * 2 : test::wq_row_stride(t, K);
  return w;
}

// E experts (gate, up [F, H]; down [H, F]) of pattern weights in format t.
struct PatternExperts {
  std::vector<test::BackendTensor> mats;
  std::vector<ExpertWeights> experts;
  PatternExperts(DType t, int E, int64_t H, int64_t F) {
    for (int e = 0; e < E; ++e) {
      mats.push_back(pattern_weight(t, F, H));
      mats.push_back(pattern_weight(t, F, H));
      mats.push_back(pattern_weight(t, H, F));
    }
    for (size_t b = 0; b < mats.size(); b += 3)
      experts.push_back({mats[b].view, mats[b + 1].view, mats[b + 2].view});
  }
};

TEST(WqBench, DISABLED_Dense) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  const Shape shapes[] = {{"V2.5 ffn gate/up", 12288, 5120}, {"V2.5 ffn down", 5120, 12288},
                          {"V2.5 q_b-like", 3072, 1536},     {"V2.5 q_b", 24576, 1536},
                          {"V2.5 o_proj", 5120, 16384},      {"V2.5 q_a+kv_a", 2112, 5120},
                          {"V2-Lite q", 3072, 2048}};
  std::printf("%-18s %-6s %5s %10s %8s %9s\n", "shape (N x K)", "fmt", "M", "us/call", "TB/s",
              "TFLOP/s");
  for (const Shape& s : shapes)
    for (DType t : {DType::W4A16, DType::FP8W}) {
      if (!bench_shape_on(s.name)) continue;
      const double w_bytes = double(s.n) * double(test::wq_row_stride(t, s.k));
      const int copies = int(std::clamp(512e6 / w_bytes, 1.0, 16.0));
      std::vector<test::BackendTensor> ws;
      for (int c = 0; c < copies; ++c) ws.push_back(pattern_weight(t, s.n, s.k));
      for (int64_t M : {1, 8, 64, 256, 512, 1024, 2048, 8192}) {
        if (!bench_m_on(M)) continue;
        auto x =
            test::upload_floats(be, DType::F32, {M, s.k}, test::random_floats(size_t(M * s.k), 3));
        auto out = test::zeros(be, DType::F32, {M, s.n});
        const double us = time_calls(copies, M <= 256, M >= 2048 ? 3 : 20, [&](int i) {
          be.matmul(x.view, ws[size_t(i)].view, out.view);
        });
        std::printf("%-18s %-6s %5lld %10.2f %8.2f %9.1f\n", s.name,
                    t == DType::W4A16 ? "W4A16" : "FP8W", static_cast<long long>(M), us,
                    w_bytes / us / 1e6, 2.0 * double(M) * double(s.n) * double(s.k) / us / 1e6);
        std::fflush(stdout);
      }
    }
}

TEST(WqBench, DISABLED_Moe) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  struct Model {
    const char* name;
    int E;
    int64_t H, F;
  };
  const Model models[] = {{"V2.5", 160, 5120, 1536}, {"V2-Lite", 64, 2048, 1408}};
  const int k = 6, kSets = 8;
  std::printf("%-8s %-6s %5s %10s %8s %8s %9s\n", "experts", "fmt", "T", "us/call", "touched",
              "TB/s", "TFLOP/s");
  for (const Model& m : models)
    for (DType t : {DType::W4A16, DType::FP8W}) {
      if (t == DType::W4A16 && m.F % 128 != 0) continue;
      const PatternExperts pe(t, m.E, m.H, m.F);
      const std::vector<ExpertWeights>& experts = pe.experts;
      const double expert_bytes = 2.0 * double(m.F) * double(test::wq_row_stride(t, m.H)) +
                                  double(m.H) * double(test::wq_row_stride(t, m.F));
      for (int64_t T : {1, 8, 64, 256, 512, 1024, 2048, 4096, 8192}) {
        if (!bench_m_on(T)) continue;
        auto x =
            test::upload_floats(be, DType::F32, {T, m.H}, test::random_floats(size_t(T * m.H), 5));
        auto out = test::zeros(be, DType::F32, {T, m.H});
        const std::vector<float> wts(size_t(T * k), 1.0f / k);
        auto wb = test::upload_floats(be, DType::F32, {T, k}, wts);
        std::vector<test::BackendTensor> ids;
        double touched = 0;
        for (int s = 0; s < kSets; ++s) {
          const auto r = test::random_floats(size_t(T * m.E), uint32_t(s * 7 + T));
          std::vector<int32_t> id(size_t(T * k));
          std::set<int32_t> distinct;
          for (int64_t i = 0; i < T; ++i) {  // top-k of random scores: distinct experts
            std::vector<int32_t> order(size_t(m.E));
            for (int e = 0; e < m.E; ++e) order[size_t(e)] = e;
            std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
              return r[size_t(i * m.E + a)] > r[size_t(i * m.E + b)];
            });
            for (int j = 0; j < k; ++j) {
              id[size_t(i * k + j)] = order[size_t(j)];
              distinct.insert(order[size_t(j)]);
            }
          }
          touched += double(distinct.size()) / kSets;
          ids.push_back(test::upload_bytes(be, DType::I32, {T, k}, id.data(), id.size() * 4));
        }
        const double us = time_calls(kSets, T <= 256, T >= 2048 ? 2 : 10, [&](int s) {
          MoeFfnParams p;
          p.x = x.view;
          p.ids = ids[size_t(s)].view;
          p.weights = wb.view;
          p.experts = experts;
          p.out = out.view;
          be.moe_ffn(p);
        });
        const double flops = 2.0 * double(T) * k * 3.0 * double(m.H) * double(m.F);
        std::printf("%-8s %-6s %5lld %10.2f %8.1f %8.2f %9.1f\n", m.name,
                    t == DType::W4A16 ? "W4A16" : "FP8W", static_cast<long long>(T), us, touched,
                    touched * expert_bytes / us / 1e6, flops / us / 1e6);
        std::fflush(stdout);
      }
    }
}

// The decode-step MoE layers as W1 (V2-Lite, BF16), W3 (the same at T = 1), W1q (V2-Lite,
// W4A16) and W5 (V2.5, W4A16; and FP8W) run them, shared experts folded in, one call each inside
// cudaProfilerStart/Stop: the targets of gpu_run.sh's ncu stage (NCU_RANGE=1 profiles only that
// range).
TEST(WqBench, DISABLED_NcuDecodeStep) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  struct Case {
    const char* name;
    int E;
    int64_t H, F;
    DType t;
    int64_t T;
  };
  const Case cases[] = {{"V2-Lite BF16 T=8", 64, 2048, 1408, DType::BF16, 8},
                        {"V2-Lite BF16 T=1", 64, 2048, 1408, DType::BF16, 1},
                        {"V2-Lite W4A16 T=8", 64, 2048, 1408, DType::W4A16, 8},
                        {"V2.5 W4A16 T=8", 160, 5120, 1536, DType::W4A16, 8},
                        {"V2.5 FP8W T=8", 160, 5120, 1536, DType::FP8W, 8}};
  const int k = 6, S = 2;
  for (const Case& c : cases) {
    const PatternExperts pe(c.t, c.E + S, c.H, c.F);
    auto x =
        test::upload_floats(be, DType::F32, {c.T, c.H}, test::random_floats(size_t(c.T * c.H), 5));
    auto out = test::zeros(be, DType::F32, {c.T, c.H});
    const std::vector<float> wts(size_t(c.T * k), 1.0f / k);
    auto wb = test::upload_floats(be, DType::F32, {c.T, k}, wts);
    std::vector<int32_t> id(size_t(c.T * k));
    for (int64_t i = 0; i < c.T; ++i)
      for (int j = 0; j < k; ++j) id[size_t(i * k + j)] = int32_t((i * 11 + j * 7) % c.E);
    auto ids = test::upload_bytes(be, DType::I32, {c.T, k}, id.data(), id.size() * 4);
    MoeFfnParams p;
    p.x = x.view;
    p.ids = ids.view;
    p.weights = wb.view;
    p.experts = pe.experts;
    p.num_shared = S;
    p.out = out.view;
    be.moe_ffn(p);  // tables, scratch
    be.synchronize();
    WQ_CUDA_OK(cudaProfilerStart());
    be.moe_ffn(p);
    be.synchronize();
    WQ_CUDA_OK(cudaProfilerStop());
    std::printf("profiled %s\n", c.name);
  }
}

}  // namespace
}  // namespace ds
