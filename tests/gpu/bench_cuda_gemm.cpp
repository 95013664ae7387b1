// GemmBench.* (disabled by default): the skinny GEMM kernel against the cuBLAS path the
// backend takes otherwise (x rounded to the weights' dtype by a conversion kernel, then
// cublasGemmEx / strided-batched), on DeepSeek-V2-Lite's decode shapes. Both are replayed from
// CUDA graphs (launch overhead excluded) over enough weight copies that every call reads its
// weights from HBM, not L2. Prints us per call and GB/s of weights read, and the skinny plan.
// GemmBench.GgufDecode: the GGUF block-weight GEMM (gemm_gguf.cu) on the same shapes, TB/s of
// blocks read at M = 1 and 8.
//   deepserve_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='GemmBench.*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_gguf.cuh"
#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/switches.h"
#include "gpu_test_util.h"

#define BENCH_CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

namespace ds {
namespace {

struct Shape {
  const char* name;
  int64_t batch, k, n;
  DType wt;
};

// DeepSeek-V2-Lite (hidden 2048, 16 heads, kv_lora_rank 512, 2 shared experts of 1408, first
// layer dense with 10944, vocab 102400). The MLA pair is the absorbed attention's per-head
// GEMMs over heads-first views of [T, 16, d] activations.
constexpr Shape kShapes[] = {
    {"q_proj", 1, 2048, 3072, DType::BF16},         {"kv_a_proj", 1, 2048, 576, DType::BF16},
    {"kv_b_proj", 1, 512, 4096, DType::BF16},       {"o_proj", 1, 2048, 2048, DType::BF16},
    {"shared gate+up", 1, 2048, 5632, DType::BF16}, {"shared down", 1, 2816, 2048, DType::BF16},
    {"dense gate+up", 1, 2048, 21888, DType::BF16}, {"dense down", 1, 10944, 2048, DType::BF16},
    {"lm_head", 1, 2048, 102400, DType::BF16},      {"router (F32)", 1, 2048, 64, DType::F32},
    {"mla q.W_uk x16", 16, 128, 512, DType::BF16},  {"mla o.W_uv x16", 16, 512, 128, DType::BF16},
};

constexpr size_t kRotateBytes = size_t(512) << 20;  // several times an H200's 60 MB L2
constexpr int kMaxCopies = 256;
constexpr int kReps = 10;

// Microseconds per call of `calls` (each enqueues one call on copy i), captured once and
// replayed kReps times.
double time_graph(cudaStream_t s, int copies, const std::function<void(int)>& call) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  auto ok = [](cudaError_t e) {
    if (e != cudaSuccess) throw Error(std::string("bench: ") + cudaGetErrorString(e));
  };
  ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < copies; ++i) call(i);
  ok(cudaStreamEndCapture(s, &graph));
  ok(cudaGraphInstantiate(&exec, graph, 0));
  ok(cudaEventCreate(&t0));
  ok(cudaEventCreate(&t1));
  ok(cudaGraphLaunch(exec, s));  // warm-up
  ok(cudaEventRecord(t0, s));
  for (int r = 0; r < kReps; ++r) ok(cudaGraphLaunch(exec, s));
  ok(cudaEventRecord(t1, s));
  ok(cudaStreamSynchronize(s));
  float ms = 0;
  ok(cudaEventElapsedTime(&ms, t0, t1));
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return 1000.0 * double(ms) / (double(kReps) * copies);
}

TEST(GemmBench, DISABLED_DeepSeekV2LiteDecodeShapes) {
  DS_REQUIRE_GPU();
  cudaDeviceProp prop{};
  BENCH_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const int sm = prop.multiProcessorCount;
  cudaStream_t s = nullptr;
  BENCH_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t ws_bytes = size_t(32) << 20;
  void* ws = nullptr;
  BENCH_CUDA_OK(cudaMalloc(&ws, ws_bytes));
  cuda::CublasGemm cublas(s, ws, ws_bytes);

  std::printf("%-16s %4s %10s %9s %10s %9s %8s   %s\n", "op (K -> N)", "M", "skinny us", "GB/s",
              "cuBLAS us", "GB/s", "speedup", "skinny plan");
  for (const Shape& sh : kShapes) {
    const int64_t es = int64_t(dtype_info(sh.wt).type_size);
    const size_t w_bytes = size_t(sh.batch * sh.n * sh.k * es);
    const int copies = int(std::clamp<size_t>(kRotateBytes / w_bytes, 2, kMaxCopies));
    void* w = nullptr;
    BENCH_CUDA_OK(cudaMalloc(&w, w_bytes * size_t(copies)));
    // Values do not change the timing: a byte pattern of small finite numbers.
    BENCH_CUDA_OK(cudaMemset(w, 0x3c, w_bytes * size_t(copies)));
    for (int64_t m : {1, 8, 16, 64}) {
      // x [M, batch, K] and out [M, batch, N]: heads-first views for the batched shapes.
      const int64_t rows = m * sh.batch;
      const std::vector<float> xh = test::random_floats(size_t(rows * sh.k), 7);
      void *x = nullptr, *out = nullptr, *xc = nullptr;
      const int64_t ld = (sh.k + 7) / 8 * 8;
      BENCH_CUDA_OK(cudaMalloc(&x, xh.size() * 4));
      BENCH_CUDA_OK(cudaMalloc(&out, size_t(rows * sh.n) * 4));
      BENCH_CUDA_OK(cudaMalloc(&xc, size_t(rows * ld * es)));
      BENCH_CUDA_OK(cudaMemcpy(x, xh.data(), xh.size() * 4, cudaMemcpyHostToDevice));

      cuda::SkinnyGemmArgs a;
      a.wtype = sh.wt;
      a.batch = sh.batch;
      a.m = m;
      a.n = sh.n;
      a.k = sh.k;
      a.x = x;
      a.x_row = sh.batch * sh.k * 4;
      a.x_batch = sh.k * 4;
      a.w_row = sh.k * es;
      a.w_batch = sh.n * sh.k * es;
      a.out = out;
      a.out_row = sh.batch * sh.n * 4;
      a.out_batch = sh.n * 4;
      auto w_copy = [&](int i) { return static_cast<uint8_t*>(w) + size_t(i) * w_bytes; };
      const double skinny_us = time_graph(s, copies, [&](int i) {
        cuda::SkinnyGemmArgs ai = a;
        ai.w = w_copy(i);
        cuda::launch_skinny_gemm(ai, sm, s);
      });

      // The backend's cuBLAS path: F32 weights take x in place, 16-bit ones a converted copy.
      TensorView xv;
      xv.data = x;
      xv.dtype = DType::F32;
      xv.ndim = 3;
      xv.shape = {sh.batch, m, sh.k, 0};
      xv.stride = {sh.k * 4, sh.batch * sh.k * 4, 4, 0};
      cuda::GemmArgs g;
      g.dtype = sh.wt;
      g.batch = sh.batch;
      g.m = m;
      g.n = sh.n;
      g.k = sh.k;
      const bool in_place = sh.wt == DType::F32;
      g.x = in_place ? x : xc;
      g.ldx = in_place ? sh.batch * sh.k : ld;
      g.stride_x = in_place ? sh.k : m * ld;
      g.ldw = sh.k;
      g.stride_w = sh.n * sh.k;
      g.out = static_cast<float*>(out);
      g.ldo = sh.batch * sh.n;
      g.stride_out = sh.n;
      const double cublas_us = time_graph(s, copies, [&](int i) {
        if (!in_place) cuda::launch_convert_rows(xv, sh.wt, xc, ld, s);
        cuda::GemmArgs gi = g;
        gi.w = w_copy(i);
        cublas.run(gi);
      });

      const cuda::skinny::Plan p = cuda::skinny::make_plan(sh.batch, m, sh.n, sh.k, int(es), sm,
                                                           cuda::g_skinny_one_wave.on());
      const double gb = double(w_bytes) / 1e3;  // GB/s = bytes / (us * 1e3)
      std::printf(
          "%-16s %4lld %10.2f %9.0f %10.2f %9.0f %7.2fx   k_groups %d, %lld CTAs x %lld, "
          "%d rounds, tm %d\n",
          sh.name, static_cast<long long>(m), skinny_us, gb / skinny_us, cublas_us, gb / cublas_us,
          cublas_us / skinny_us, p.k_groups, static_cast<long long>(p.ctas),
          static_cast<long long>(sh.batch), p.rounds, p.tm);
      std::fflush(stdout);
      cudaFree(x);
      cudaFree(out);
      cudaFree(xc);
    }
    cudaFree(w);
  }
  cudaStreamDestroy(s);
  cudaFree(ws);
}

TEST(GemmBench, DISABLED_GgufDecode) {
  DS_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  BENCH_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct GgufShape {
    const char* name;
    int64_t k, n;
  };
  const GgufShape shapes[] = {{"q_proj", 2048, 3072},
                              {"shared gate+up", 2048, 5632},
                              {"dense gate+up", 2048, 21888},
                              {"lm_head", 2048, 102400}};
  std::printf("%-16s %-5s %4s %10s %9s\n", "op (K -> N)", "type", "M", "us", "TB/s");
  for (DType t : {DType::Q4_K, DType::Q8_0, DType::Q6_K, DType::Q4_0}) {
    for (const GgufShape& sh : shapes) {
      const size_t w_bytes =
          size_t(sh.n) * size_t(sh.k / dtype_info(t).block_size) * size_t(dtype_info(t).type_size);
      const int copies = int(std::clamp<size_t>(kRotateBytes / w_bytes, 2, kMaxCopies));
      void* w = nullptr;
      BENCH_CUDA_OK(cudaMalloc(&w, w_bytes * size_t(copies)));
      BENCH_CUDA_OK(cudaMemset(w, 0x3c, w_bytes * size_t(copies)));  // finite fp16 scales
      for (int64_t m : {1, 8}) {
        const std::vector<float> xh = test::random_floats(size_t(m * sh.k), 7);
        void *x = nullptr, *out = nullptr;
        BENCH_CUDA_OK(cudaMalloc(&x, xh.size() * 4));
        BENCH_CUDA_OK(cudaMalloc(&out, size_t(m * sh.n) * 4));
        BENCH_CUDA_OK(cudaMemcpy(x, xh.data(), xh.size() * 4, cudaMemcpyHostToDevice));
        cuda::GgufGemmArgs a;
        a.dtype = t;
        a.m = m;
        a.n = sh.n;
        a.k = sh.k;
        a.x = static_cast<const float*>(x);
        a.x_row = sh.k;
        a.w_row = int64_t(w_bytes) / sh.n;
        a.out = static_cast<float*>(out);
        a.out_row = sh.n;
        const double us = time_graph(s, copies, [&](int i) {
          cuda::GgufGemmArgs ai = a;
          ai.w = static_cast<const uint8_t*>(w) + size_t(i) * w_bytes;
          cuda::launch_gguf_gemm(ai, s);
        });
        std::printf("%-16s %-5s %4lld %10.2f %9.3f\n", sh.name, std::string(dtype_name(t)).c_str(),
                    static_cast<long long>(m), us, double(w_bytes) / (us * 1e6));
        std::fflush(stdout);
        cudaFree(x);
        cudaFree(out);
      }
      cudaFree(w);
    }
  }
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace ds
