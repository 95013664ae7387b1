// The skinny GEMM on the GPU: against float64 (x used exactly, F32 accumulation bound) and bit
// for bit against the host simulation of the same kernel (skinny_gemm_sim.h), over awkward
// shapes, padded and heads-first layouts and all weight dtypes; through the backend (small M
// takes this path), batch invariance and CUDA-graph replay.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/switches.h"
#include "gpu_test_util.h"
#include "skinny_gemm_sim.h"

namespace ds {
namespace {

using skinny_sim::Problem;
using skinny_sim::Spec;
using test::BackendTensor;

int device_sm_count() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) throw Error("cudaGetDeviceProperties");
  return prop.multiProcessorCount;
}

std::string spec_str(const Spec& s) {
  return std::string(dtype_name(s.wt)) + " B " + std::to_string(s.batch) + " M " +
         std::to_string(s.m) + " N " + std::to_string(s.n) + " K " + std::to_string(s.k) +
         (s.permuted ? " heads-first" : "") + (s.x_pad || s.w_pad || s.out_pad ? " padded" : "");
}

// A problem's buffers on the shared CUDA backend.
struct OnDevice {
  BackendTensor x, w, out;
};

OnDevice upload(const Problem& p) {
  Backend& g = test::cuda_backend();
  OnDevice d;
  d.x = test::upload_floats(g, DType::F32, {int64_t(p.x.size())}, p.x);
  d.w = test::upload_bytes(g, p.s.wt, {int64_t(p.w_values.size())}, p.w.data(), p.w.size());
  d.out = test::upload_floats(g, DType::F32, {int64_t(p.out0.size())}, p.out0);
  return d;
}

// Views of the problem's operands over device buffers, as a model would pass them.
struct Views {
  TensorView x, w, out;
};
Views views(const Problem& p, const OnDevice& d) {
  const Spec& s = p.s;
  if (s.batch == 1 && !s.permuted)
    return {test::view_of(d.x, {s.m, s.k}, {p.x_row, 1}),
            test::view_of(d.w, {s.n, s.k}, {p.w_row, 1}, p.w_off),
            test::view_of(d.out, {s.m, s.n}, {p.o_row, 1})};
  return {test::view_of(d.x, {s.batch, s.m, s.k}, {p.x_batch, p.x_row, 1}),
          test::view_of(d.w, {s.batch, s.n, s.k}, {p.w_batch, p.w_row, 1}, p.w_off),
          test::view_of(d.out, {s.batch, s.m, s.n}, {p.o_batch, p.o_row, 1})};
}

// launch_skinny_gemm on a private stream (so any M may be forced through the kernel).
std::vector<float> run_kernel(const Problem& p, int sm_count) {
  Backend& g = test::cuda_backend();
  const OnDevice d = upload(p);
  g.synchronize();
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    throw Error("cudaStreamCreate");
  cuda::launch_skinny_gemm(p.args(d.x.view.data, d.w.view.data, d.out.view.data), sm_count, s);
  const cudaError_t e = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  if (e != cudaSuccess) throw Error(std::string("skinny GEMM: ") + cudaGetErrorString(e));
  return test::download_floats(g, d.out);
}

::testing::AssertionResult same_bits(const std::vector<float>& got, const std::vector<float>& want,
                                     const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], 4) != 0 && !(std::isnan(got[i]) && std::isnan(want[i]))) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " elements differ; first at " << first
         << ": got " << got[first] << ", want " << want[first];
}

::testing::AssertionResult near_float64(const Problem& p, const std::vector<float>& got,
                                        const std::string& what) {
  const skinny_sim::Expected e = skinny_sim::expected(p);
  std::vector<double> bound(e.abs_sum.size());
  for (size_t i = 0; i < bound.size(); ++i)
    bound[i] = skinny_sim::f32_bound_factor(p.s.k) * e.abs_sum[i];
  return test::all_close_bounds(got, e.want, bound, what);
}

std::vector<Spec> kernel_specs() {
  std::vector<Spec> v;
  for (DType wt : {DType::BF16, DType::F16, DType::F32}) {
    for (int64_t m = 1; m <= 17; ++m) v.push_back({wt, 1, m, 64, 120, 4, 8, 3, 1, false});
    const int64_t shapes[][3] = {
        {1, 1, 8},      {17, 1, 8},      {3, 3, 8},       {2, 3, 120},     {1, 576, 2048},
        {5, 576, 2048}, {16, 576, 2048}, {1, 3072, 2048}, {8, 3072, 2048}, {17, 3072, 2048},
        {1, 64, 10944}, {9, 64, 10944},  {16, 3, 10944},  {4, 576, 10944}, {1, 3072, 10944}};
    for (const auto& s : shapes) {
      v.push_back({wt, 1, s[0], s[1], s[2], 0, 0, 0, 0, false});
      v.push_back({wt, 1, s[0], s[1], s[2], 4, 8, 3, 1, false});
    }
  }
  return v;
}

TEST(SkinnyGemm, KernelMatchesFloat64AndHostSim) {
  DS_REQUIRE_GPU();
  const int sm = device_sm_count();
  uint32_t seed = 100;
  struct Restore {
    ~Restore() {
      cuda::g_skinny_early.force(-1);
      cuda::g_skinny_one_wave.force(-1);
    }
  } restore;
  for (const Spec& s : kernel_specs()) {
    SCOPED_TRACE(spec_str(s));
    const Problem p = skinny_sim::make_problem(s, ++seed);
    // With the first weight step loaded before the wait (the default) and after it; with the
    // default K split and the one-wave one (the simulation follows the switch).
    for (int mode = 0; mode < 3; ++mode) {
      const int early = mode != 1, one_wave = mode == 2;
      cuda::g_skinny_early.force(early);
      cuda::g_skinny_one_wave.force(one_wave);
      const std::vector<float> got = run_kernel(p, sm);
      EXPECT_TRUE(near_float64(p, got, "skinny GEMM vs float64"))
          << "early " << early << ", one wave " << one_wave;
      EXPECT_TRUE(same_bits(got, skinny_sim::simulate(p, sm), "skinny GEMM vs host simulation"))
          << "early " << early << ", one wave " << one_wave;
    }
  }
}

// The strided-batched form of MLA's absorbed attention: 16 heads, K 128 -> N 512 and
// 512 -> 128, x and out heads-first views of [T, H, d] buffers.
TEST(SkinnyGemm, BatchedFormMatchesFloat64AndHostSim) {
  DS_REQUIRE_GPU();
  const int sm = device_sm_count();
  uint32_t seed = 200;
  for (DType wt : {DType::BF16, DType::F16, DType::F32}) {
    for (int64_t m : {1, 5, 16, 17}) {
      for (const Spec& s : {Spec{wt, 16, m, 512, 128, 64, 0, 0, 0, true},
                            Spec{wt, 16, m, 128, 512, 0, 8, 64, 2, true},
                            Spec{wt, 3, m, 7, 40, 4, 8, 1, 1, false}}) {
        SCOPED_TRACE(spec_str(s));
        const Problem p = skinny_sim::make_problem(s, ++seed);
        const std::vector<float> got = run_kernel(p, sm);
        EXPECT_TRUE(near_float64(p, got, "batched skinny GEMM vs float64"));
        EXPECT_TRUE(same_bits(got, skinny_sim::simulate(p, sm), "batched vs host simulation"));
      }
    }
  }
}

// matmul / batched_matmul with M <= kSkinnyMaxM on aligned views run the skinny kernel: the
// same bits as its simulation.
TEST(SkinnyGemm, BackendTakesTheSkinnyPath) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const int sm = device_sm_count();
  uint32_t seed = 300;
  for (DType wt : {DType::BF16, DType::F32}) {
    for (const Spec& s : {Spec{wt, 1, 1, 576, 2048, 4, 8, 3, 1, false},
                          Spec{wt, 1, cuda::kSkinnyMaxM, 64, 2048, 0, 0, 0, 0, false},
                          Spec{wt, 16, 3, 512, 128, 64, 0, 0, 0, true}}) {
      SCOPED_TRACE(spec_str(s));
      const Problem p = skinny_sim::make_problem(s, ++seed);
      const OnDevice d = upload(p);
      const Views v = views(p, d);
      if (s.batch == 1) {
        ASSERT_TRUE(cuda::use_skinny_gemm(cuda::skinny_matmul_args(v.x, v.w, v.out)));
        g.matmul(v.x, v.w, v.out);
      } else {
        ASSERT_TRUE(cuda::use_skinny_gemm(cuda::skinny_batched_args(v.x, v.w, v.out)));
        g.batched_matmul(v.x, v.w, v.out);
      }
      EXPECT_TRUE(same_bits(test::download_floats(g, d.out), skinny_sim::simulate(p, sm),
                            "backend vs simulated skinny kernel"));
    }
  }
}

// Row i's result does not depend on which other rows share the call: bit-identical alone,
// at another position, and inside M = 3 and kSkinnyMaxM (weights small enough for the skinny
// path at every M).
TEST(SkinnyGemm, RowsAreBatchInvariant) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const int64_t M = cuda::kSkinnyMaxM, k = 2048;
  for (DType wt : {DType::BF16, DType::F32}) {
    for (int64_t n : {64, 576}) {
      SCOPED_TRACE(std::string(dtype_name(wt)) + " N " + std::to_string(n));
      const BackendTensor x =
          test::upload_floats(g, DType::F32, {M, k}, test::random_floats(size_t(M * k), 41));
      const BackendTensor w =
          test::upload_floats(g, wt, {n, k}, test::random_floats(size_t(n * k), 42));
      BackendTensor all = test::zeros(g, DType::F32, {M, n});
      g.matmul(x.view, w.view, all.view);
      const std::vector<float> want = test::download_floats(g, all);
      for (int64_t first : {0, 5}) {
        for (int64_t m : {1, 3}) {
          BackendTensor part = test::zeros(g, DType::F32, {m, n});
          g.matmul(test::view_of(x, {m, k}, {k, 1}, first * k), w.view, part.view);
          const std::vector<float> got = test::download_floats(g, part);
          const std::vector<float> rows(want.begin() + first * n, want.begin() + (first + m) * n);
          EXPECT_TRUE(same_bits(got, rows,
                                "rows " + std::to_string(first) + ".." +
                                    std::to_string(first + m - 1) + " vs M " + std::to_string(M)));
        }
      }
    }
  }
}

// Captured once through the backend, replayed after x changed in place: the replay computes
// on the new x (no host-side state baked in) with the same bits as the kernel's simulation.
TEST(SkinnyGemm, GraphReplayReadsNewInputs) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const int sm = device_sm_count();
  for (const Spec& s : {Spec{DType::BF16, 1, 4, 576, 2048, 4, 8, 3, 1, false},
                        Spec{DType::BF16, 16, 2, 128, 512, 0, 0, 0, 0, true}}) {
    SCOPED_TRACE(spec_str(s));
    const Problem p = skinny_sim::make_problem(s, 400);
    Problem p2 = skinny_sim::make_problem(s, 401);
    p2.w = p.w;  // same weights and initial output, new activations
    p2.w_values = p.w_values;
    p2.out0 = p.out0;
    const OnDevice d = upload(p);
    const Views v = views(p, d);
    g.synchronize();
    g.begin_capture();
    if (s.batch == 1)
      g.matmul(v.x, v.w, v.out);
    else
      g.batched_matmul(v.x, v.w, v.out);
    const int graph = g.end_capture();
    g.upload(d.x.view, p2.x.data(), p2.x.size() * 4);
    g.replay(graph);
    EXPECT_TRUE(same_bits(test::download_floats(g, d.out), skinny_sim::simulate(p2, sm),
                          "graph replay on new x vs simulation"));
  }
}

}  // namespace
}  // namespace ds
