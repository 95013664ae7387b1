// GraphSet (backend/cuda/graphs.h): a capture cut into pieces replays every op once, in order.
// GraphBench.DISABLED_LaunchLatency: what a graph launch costs before its first kernel runs, by
// kernel count and by pieces, and how much of it a step that waits for its results pays:
//   deepserve_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='GraphBench.*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/graphs.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"

#define GRAPH_CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr
#define GRAPH_REQUIRE_GPU() \
  if (::ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device here"

namespace ds {
namespace {

// x = 3x + i (mod 2^32): the result depends on the order of the launches, not just their count.
__global__ void step_kernel(uint32_t* x, uint32_t i) {
  cuda::pdl::enter();
  if (threadIdx.x == 0 && blockIdx.x == 0) *x = *x * 3u + i;
}

uint32_t chain(uint32_t x, int from, int to) {
  for (int i = from; i < to; ++i) x = x * 3u + uint32_t(i);
  return x;
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~Stream() { cudaStreamDestroy(s); }
};

// Records launches 0..n-1 with a cut after each (the model's layer boundaries), every `every`.
int record(cuda::GraphSet& gs, cudaStream_t s, uint32_t* x, int n, long long every) {
  gs.begin(s, every);
  for (int i = 0; i < n; ++i) {
    if (i > 0) gs.cut();
    cuda::pdl::launch(step_kernel, dim3(1), dim3(32), 0, s, x, uint32_t(i));
  }
  return gs.end();
}

TEST(GraphSet, PiecesReplayEveryOpInOrder) {
  GRAPH_REQUIRE_GPU();
  Stream st;
  uint32_t* x = nullptr;
  GRAPH_CUDA_OK(cudaMalloc(&x, 4));
  cuda::GraphSet gs;
  const int n = 10;
  // every: 0 one graph; 1 a piece a launch; 3 pieces of 3, 3, 3, 1; 20 past the end: one graph.
  const std::pair<long long, size_t> cases[] = {{0, 1}, {1, 10}, {3, 4}, {20, 1}};
  for (const auto& [every, pieces] : cases) {
    const int g = record(gs, st.s, x, n, every);
    EXPECT_EQ(gs.pieces(g), pieces) << "every " << every;
    EXPECT_FALSE(gs.capturing());
    uint32_t v = 7;
    GRAPH_CUDA_OK(cudaMemcpy(x, &v, 4, cudaMemcpyHostToDevice));
    for (int rep = 0; rep < 3; ++rep) gs.replay(g, st.s);
    GRAPH_CUDA_OK(cudaStreamSynchronize(st.s));
    uint32_t got = 0;
    GRAPH_CUDA_OK(cudaMemcpy(&got, x, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, chain(chain(chain(7, 0, n), 0, n), 0, n)) << "every " << every;
  }
  // A cut outside a capture does nothing.
  gs.cut();
  EXPECT_FALSE(gs.capturing());
  gs.reset();
  GRAPH_CUDA_OK(cudaFree(x));
}

// Empty-ish kernels (each spins ~1 us on one CTA) in graphs of n, whole or cut every 20
// launches. Per case: the host time of the launch calls, the time from the launch to the
// results when the host waits for every step (as the engine's decode loop does), and the time a
// step takes when launches queue back to back (the device alone). The first minus the last is
// what a waiting step pays for the launch.
__global__ void spin_kernel(uint32_t* sink, int cycles) {
  cuda::pdl::enter();
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(sink, 1u);
}

struct PdlForced {
  explicit PdlForced(int mode) { cuda::g_pdl.force(mode); }
  ~PdlForced() { cuda::g_pdl.force(-1); }
};

TEST(GraphBench, DISABLED_LaunchLatency) {
  GRAPH_REQUIRE_GPU();
  Stream st;
  uint32_t* sink = nullptr;
  GRAPH_CUDA_OK(cudaMalloc(&sink, 4));
  using clk = std::chrono::steady_clock;
  auto us = [](clk::duration d) { return std::chrono::duration<double, std::micro>(d).count(); };
  std::printf("%6s %6s %6s %12s %12s %12s %12s\n", "kernels", "pieces", "pdl", "launch_us",
              "waited_us", "queued_us", "exposed_us");
  for (int pdl_on : {1, 0}) {
    const PdlForced forced(pdl_on);
    for (int n : {64, 330, 1150})
      for (long long every : {0LL, 20LL, 5LL}) {
        cuda::GraphSet gs;
        gs.begin(st.s, every);
        for (int i = 0; i < n; ++i) {
          if (i > 0) gs.cut();
          cuda::pdl::launch(spin_kernel, dim3(8), dim3(128), 0, st.s, sink, 1500);
        }
        const int g = gs.end();
        for (int w = 0; w < 5; ++w) gs.replay(g, st.s);
        GRAPH_CUDA_OK(cudaStreamSynchronize(st.s));
        const int reps = 40;
        double launch = 0, waited = 0;
        for (int r = 0; r < reps; ++r) {
          const auto t0 = clk::now();
          gs.replay(g, st.s);
          const auto t1 = clk::now();
          GRAPH_CUDA_OK(cudaStreamSynchronize(st.s));
          const auto t2 = clk::now();
          launch += us(t1 - t0);
          waited += us(t2 - t0);
        }
        cudaEvent_t e0, e1;
        GRAPH_CUDA_OK(cudaEventCreate(&e0));
        GRAPH_CUDA_OK(cudaEventCreate(&e1));
        GRAPH_CUDA_OK(cudaEventRecord(e0, st.s));
        for (int r = 0; r < reps; ++r) gs.replay(g, st.s);
        GRAPH_CUDA_OK(cudaEventRecord(e1, st.s));
        GRAPH_CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0;
        GRAPH_CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        const double queued = 1e3 * ms / reps;
        std::printf("%6d %6zu %6d %12.1f %12.1f %12.1f %12.1f\n", n, gs.pieces(g), pdl_on,
                    launch / reps, waited / reps, queued, waited / reps - queued);
      }
  }
  GRAPH_CUDA_OK(cudaFree(sink));
}

}  // namespace
}  // namespace ds
