// MoeBench.* (disabled by default): moe_ffn on DeepSeek-V2-Lite shapes, timed with CUDA
// events; prints achieved GB/s of the expert weights each call touches.
//   deepserve_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='MoeBench.*'
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <set>
#include <vector>

#include "backend/cuda/switches.h"
#include "moe_test_util.h"

namespace ds {
namespace {

using moe_test::DirectCuda;
using moe_test::FfnCase;
using moe_test::make_case;
using moe_test::make_experts;

void run_moe_bench(int S, const std::vector<int>& Ts, bool decode_only);

// DeepSeek-V2-Lite's routed experts (64 x [1408, 2048] BF16, top-6) over 16 routings per T,
// cycled so consecutive calls touch different experts, alone (S = 0) and with the two shared
// experts folded in as the model runs them (S = 2). GB/s counts the weights of the distinct
// experts each call touches.
TEST(MoeBench, DISABLED_DeepSeekV2Lite) {
  for (int S : {0, 2}) run_moe_bench(S, {1, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192}, false);
}

// The decode kernels alone at decode-sized steps (graph replay), for quick A/B runs of their
// switches (gpu_run.sh moebench with MOEBENCH_FILTER and MOEBENCH_ENVS).
TEST(MoeBench, DISABLED_DecodeSmall) {
  for (int S : {0, 2}) run_moe_bench(S, {1, 2, 3, 4, 5, 8}, true);
}

void run_moe_bench(int S, const std::vector<int>& Ts, bool decode_only) {
  DS_REQUIRE_GPU();
  Backend& g = test::cuda_backend();
  const int E = 64 + S, H = 2048, F = 1408, k = 6, kSets = 16;
  const auto ex = make_experts(E, H, F, DType::BF16, 17);
  const double expert_bytes = 3.0 * H * F * 2;
  std::printf("shared experts: %d\n", S);
  DirectCuda d;
  cudaEvent_t t0, t1;
  MOE_CUDA_OK(cudaEventCreate(&t0));
  MOE_CUDA_OK(cudaEventCreate(&t1));
  std::printf("%6s %-14s %10s %9s %9s %8s\n", "T", "path", "us/call", "experts", "GB/s", "TFLOP/s");
  for (int T : Ts) {
    if (S > 0 && T == 1024) continue;
    std::vector<std::unique_ptr<FfnCase>> sets;
    double touched = 0;
    for (int s = 0; s < kSets; ++s) {
      sets.push_back(make_case(*ex, T, k, false, 1000 + uint64_t(T * kSets + s), 0, S));
      const std::set<int32_t> distinct(sets.back()->ids.cpu.ptr<int32_t>(),
                                       sets.back()->ids.cpu.ptr<int32_t>() + T * k);
      touched += double(distinct.size() + size_t(S)) / kSets;
    }
    // Router logits per set (decode_only: the rows with the route kernel before each call).
    MoeRouteParams route;
    route.top_k = k;
    std::vector<test::BackendTensor> logits;
    for (int s = 0; s < kSets; ++s)
      logits.push_back(test::upload_floats(g, DType::F32, {T, E - S},
                                           test::random_floats(size_t(T) * (E - S), 300 + s)));
    g.synchronize();
    // GB/s of touched weights; TFLOP/s at 2 * 3 * H * F flops per (token, expert) assignment.
    auto report = [&](const char* name, double us) {
      std::printf("%6d %-14s %10.2f %9.1f %9.1f %8.1f\n", T, name, us, touched,
                  touched * expert_bytes / (us * 1e-6) / 1e9,
                  6.0 * H * F * double(T) * (k + S) / (us * 1e-6) / 1e12);
    };
    const bool big = T > 1024;  // the decode kernels are far off the pace there
    // Graph-capturable paths replayed from a graph of all sets (launch overhead excluded).
    // (MOE_CUDA_OK asserts, so the time comes back through us.)
    // with_route: each call after the router's top-k on its own logits, as the model runs it
    // (a small kernel between two MoE layers instead of the previous layer's last one). The
    // route writes the sets' ids and weights, so the rows timed after it run on its picks (top-6
    // of random logits: as many distinct experts per token; `experts` counts the first routing).
    // stages: moe_ffn's (0: no MoE call, the route kernels alone).
    auto graph_us = [&](cuda::MoeFfnPath path, double& us, bool with_route = false,
                        int stages = cuda::kMoeAllStages) {
      for (auto& s : sets) d.ffn(s->gpu, path);
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      MOE_CUDA_OK(cudaStreamBeginCapture(d.stream(), cudaStreamCaptureModeGlobal));
      for (size_t i = 0; i < sets.size(); ++i) {
        if (with_route)
          cuda::moe_route(d.ctx(), logits[i].view, route, sets[i]->gpu.ids, sets[i]->gpu.weights);
        if (stages != 0) cuda::moe_ffn(d.ctx(), sets[i]->gpu, path, stages);
      }
      MOE_CUDA_OK(cudaStreamEndCapture(d.stream(), &graph));
      MOE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      MOE_CUDA_OK(cudaGraphLaunch(exec, d.stream()));
      const int reps = big ? 3 : 20;
      MOE_CUDA_OK(cudaEventRecord(t0, d.stream()));
      for (int r = 0; r < reps; ++r) MOE_CUDA_OK(cudaGraphLaunch(exec, d.stream()));
      MOE_CUDA_OK(cudaEventRecord(t1, d.stream()));
      d.sync();
      float ms = 0;
      MOE_CUDA_OK(cudaEventElapsedTime(&ms, t0, t1));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      us = 1000.0 * ms / (reps * kSets);
    };
    if (decode_only) {  // the route kernels alone: what the -route rows pay besides the MoE
      double route_us = 0;
      graph_us(cuda::MoeFfnPath::Decode, route_us, true, 0);
      report("route-only", route_us);
    }
    for (cuda::MoeFfnPath path :
         {cuda::MoeFfnPath::Decode, cuda::MoeFfnPath::Split, cuda::MoeFfnPath::Grouped,
          cuda::MoeFfnPath::Streamed, cuda::MoeFfnPath::Wide}) {
      if (big && path == cuda::MoeFfnPath::Decode) continue;
      if (path == cuda::MoeFfnPath::Split && T > 64) continue;
      if (decode_only && path != cuda::MoeFfnPath::Decode && path != cuda::MoeFfnPath::Split)
        continue;
      if (path == cuda::MoeFfnPath::Streamed && T > 1024) continue;
      if (path == cuda::MoeFfnPath::Wide && T < 32) continue;
      double us = 0;
      if (path == cuda::MoeFfnPath::Grouped) cuda::g_moe_tile32.force(0);  // 64-row tiles
      graph_us(path, us);
      cuda::g_moe_tile32.force(-1);
      if (decode_only) {  // the decode paths again, each after the router's top-k
        const bool split = path == cuda::MoeFfnPath::Split;
        double routed_us = 0;
        graph_us(path, routed_us, true);
        report(split ? "split-route" : "decode-route", routed_us);
        // Each of the two main launches alone after the route (for timing only: the other's
        // output is stale), to see where the fixed cost of a call goes.
        graph_us(path, routed_us, true, 1);
        report(split ? "split-route-strips" : "decode-route-gu", routed_us);
        graph_us(path, routed_us, true, 2);
        report(split ? "split-route-reduce" : "decode-route-down", routed_us);
      }
      report(path == cuda::MoeFfnPath::Decode     ? "decode-graph"
             : path == cuda::MoeFfnPath::Split    ? "split-graph"
             : path == cuda::MoeFfnPath::Grouped  ? "grouped-graph"
             : path == cuda::MoeFfnPath::Streamed ? "streamed-graph"
                                                  : "wide-graph",
             us);
      if (path == cuda::MoeFfnPath::Grouped && T <= cuda::moe::kSmallTileMaxTokens) {  // 32-row
        cuda::g_moe_tile32.force(1);
        graph_us(path, us);
        report("grouped32-graph", us);
        cuda::g_moe_tile32.force(-1);
      }
    }

    if (decode_only) continue;
    // Eager launches, then the prefill path (syncs once per call).
    for (cuda::MoeFfnPath path :
         {cuda::MoeFfnPath::Decode, cuda::MoeFfnPath::Grouped, cuda::MoeFfnPath::Prefill}) {
      if (big && path == cuda::MoeFfnPath::Decode) continue;
      const int eager_reps = big ? 2 : 5;
      for (auto& s : sets) cuda::moe_ffn(d.ctx(), s->gpu, path);
      d.sync();
      MOE_CUDA_OK(cudaEventRecord(t0, d.stream()));
      for (int r = 0; r < eager_reps; ++r)
        for (auto& s : sets) cuda::moe_ffn(d.ctx(), s->gpu, path);
      MOE_CUDA_OK(cudaEventRecord(t1, d.stream()));
      d.sync();
      float ms = 0;
      MOE_CUDA_OK(cudaEventElapsedTime(&ms, t0, t1));
      report(path == cuda::MoeFfnPath::Decode    ? "decode-eager"
             : path == cuda::MoeFfnPath::Grouped ? "grouped-eager"
                                                 : "prefill",
             1000.0 * ms / (eager_reps * kSets));
    }
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
}

}  // namespace
}  // namespace ds
