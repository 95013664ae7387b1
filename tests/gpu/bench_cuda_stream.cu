// StreamBench.DISABLED_Patterns: what read bandwidth the H200 gives to the access patterns the
// quantized decode kernels use (gemm_wq.cu's run_cta), against plain streams. No model code runs:
// a probe kernel copies a CTA's bytes into shared memory through a cp.async pipeline and touches
// each staged byte, so the only variables are the pattern, the pipeline depth, the CTAs an SM
// and how many jobs a CTA streams one after another.
//   rows x chunk: a stage takes `chunk` bytes of each of `rows` rows `row_bytes` apart (the wq
//     tiles: 128 rows, 256 bytes of an FP8W row of K = 2048 a stage; 128 bytes of a W4A16 row of
//     K = 5120); rows = 1 is one contiguous span a stage.
//   jobs: a CTA streams `jobs` such blocks back to back with one pipeline (the next block's
//     first stages in flight while the last ones are used), where the wq kernels start a new CTA
//     (and a new pipeline) for every block.
// Prints TB/s of bytes read (each case reads 512 MB, or ~200 MB for the W1f-sized launches: past
// the 60 MB L2 either way, alternating between two buffers).
//   deepserve_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='StreamBench.*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <tuple>
#include <utility>

#include "backend/cuda/mma_ptx.cuh"

#define STREAM_CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

namespace ds {
namespace {

namespace ptx = cuda::ptx;

constexpr int kThreads = 128;

struct Pattern {
  int rows;           // rows a stage reads from
  int64_t row_bytes;  // bytes between rows (and a block's columns)
  int chunk;          // bytes of each row a stage reads (a multiple of 16)
  int jobs;           // blocks a CTA streams with one pipeline
  int spin = 0;       // cycles a stage's consumer spends after its loads (the products' stand-in)
  int row_read = 0;   // bytes of each row streamed (a multiple of chunk; 0: all of row_bytes), so
                      // a row may hold bytes no stage reads, as a quantized row's scale words
  __host__ __device__ int64_t streamed() const { return row_read > 0 ? row_read : row_bytes; }
};

// CTA c streams blocks c * jobs .. c * jobs + jobs - 1 (rows * row_bytes bytes each, in order)
// stage by stage, every stage's copies spread over the threads; each thread then folds the
// 16-byte units it would read as a fragment into `acc` (written once, so nothing is dead).
template <int kStages>
__global__ void __launch_bounds__(kThreads)
    stream_kernel(const uint8_t* base, Pattern p, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s0 = ptx::smem_u32(smem);
  const int stage_bytes = p.rows * p.chunk, units = stage_bytes / 16, per_row = p.chunk / 16;
  const int kt_block = int(p.streamed() / p.chunk), KT = kt_block * p.jobs;
  const int64_t block_bytes = int64_t(p.rows) * p.row_bytes;
  const uint8_t* first = base + int64_t(blockIdx.x) * p.jobs * block_bytes;
  auto load = [&](int buf, int kt) {
    const uint8_t* blk = first + int64_t(kt / kt_block) * block_bytes + (kt % kt_block) * p.chunk;
    for (int i = int(threadIdx.x); i < units; i += kThreads) {
      const int r = i / per_row, c = i - r * per_row;
      ptx::cp_async16(s0 + uint32_t(buf * stage_bytes + i * 16),
                      blk + int64_t(r) * p.row_bytes + c * 16, true);
    }
  };
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load(s, s);
    ptx::cp_async_commit();
  }
  uint32_t acc = 0;
  for (int kt = 0; kt < KT; ++kt) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (kt + kStages - 1 < KT) load((kt + kStages - 1) % kStages, kt + kStages - 1);
    ptx::cp_async_commit();
    const uint4* st = reinterpret_cast<const uint4*>(smem + (kt % kStages) * stage_bytes);
    for (int i = int(threadIdx.x); i < units; i += kThreads) {
      const uint4 v = st[i];
      acc ^= v.x + v.y + v.z + v.w;
    }
    if (p.spin > 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < p.spin) acc += 1;
    }
  }
  ptx::cp_async_wait<0>();
  sink[blockIdx.x * kThreads + threadIdx.x] = acc;
}

// The ceiling: every thread reads 16-byte units with plain loads, kUnroll in flight, the grid
// striding over the whole span.
constexpr int kUnroll = 8;
__global__ void __launch_bounds__(256)
    plain_kernel(const uint4* base, int64_t units, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < units; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(base + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x + v[u].y + v[u].z + v[u].w;
  }
  for (; i < units; i += stride) acc ^= __ldcs(base + i).x;
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

struct Buffers {
  uint8_t* buf[2] = {nullptr, nullptr};
  uint32_t* sink = nullptr;
  size_t bytes = 0;
  ~Buffers() {
    cudaFree(buf[0]);
    cudaFree(buf[1]);
    cudaFree(sink);
  }
};

// Milliseconds per call of launch(buffer), alternating the two buffers, after two warm-ups.
template <typename Fn>
double time_ms(const Buffers& b, int calls, Fn&& launch) {
  launch(b.buf[0]);
  launch(b.buf[1]);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int i = 0; i < calls; ++i) launch(b.buf[i & 1]);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / calls;
}

template <int kStages>
void run_case(const Buffers& b, const char* name, Pattern p, int occ, int sms, int64_t blocks = 0) {
  const int stage_bytes = p.rows * p.chunk;
  const int64_t block_bytes = int64_t(p.rows) * p.row_bytes;
  // Shared memory sized so that at most `occ` CTAs fit an SM (228 KB an SM, 1 KB reserved a CTA).
  const int need = kStages * stage_bytes;
  const int budget = (228 << 10) / occ - (1 << 10);
  if (need > budget || budget > (227 << 10)) {
    std::printf("%-34s %6d %3d %4d %5d   (does not fit)\n", name, kStages, occ, p.jobs, p.spin);
    return;
  }
  const int smem = std::max(need, occ == 1 ? budget : (228 << 10) / (occ + 1) + 1);
  cudaFuncSetAttribute(stream_kernel<kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int resident = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, stream_kernel<kStages>, kThreads, smem);
  const int64_t ctas = blocks > 0 ? blocks / p.jobs : int64_t(b.bytes / 2) / (block_bytes * p.jobs);
  const double ms = time_ms(b, 10, [&](const uint8_t* buf) {
    stream_kernel<kStages><<<unsigned(ctas), kThreads, smem>>>(buf, p, b.sink);
  });
  const double bytes = double(ctas) * p.jobs * p.rows * p.streamed();
  std::printf("%-34s %6d %3d %4d %5d %8lld %7.2f %9.1f %8.3f\n", name, kStages, resident, p.jobs,
              p.spin, static_cast<long long>(ctas), double(ctas) / (double(resident) * sms),
              ms * 1e3, bytes / (ms * 1e-3) / 1e12);
  ASSERT_EQ(cudaSuccess, cudaGetLastError()) << name;
}

TEST(StreamBench, DISABLED_Patterns) {
  int dev = 0, sms = 0;
  STREAM_CUDA_OK(cudaGetDevice(&dev));
  STREAM_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  Buffers b;
  b.bytes = size_t(1) << 30;  // two buffers of 512 MB
  STREAM_CUDA_OK(cudaMalloc(&b.buf[0], b.bytes / 2));
  STREAM_CUDA_OK(cudaMalloc(&b.buf[1], b.bytes / 2));
  STREAM_CUDA_OK(cudaMalloc(&b.sink, size_t(1) << 24));
  STREAM_CUDA_OK(cudaMemset(b.buf[0], 1, b.bytes / 2));
  STREAM_CUDA_OK(cudaMemset(b.buf[1], 2, b.bytes / 2));
  {
    const int64_t units = int64_t(b.bytes / 2) / 16;
    const double ms = time_ms(b, 10, [&](const uint8_t* buf) {
      plain_kernel<<<unsigned(sms * 8), 256>>>(reinterpret_cast<const uint4*>(buf), units, b.sink);
    });
    std::printf("plain loads, %d in flight a thread: %.1f us, %.3f TB/s\n", kUnroll, ms * 1e3,
                double(b.bytes / 2) / (ms * 1e-3) / 1e12);
  }
  std::printf("%-34s %6s %3s %4s %5s %8s %7s %9s %8s\n", "pattern", "stages", "occ", "jobs", "spin",
              "ctas", "waves", "us/call", "TB/s");
  // A CTA's block is 256 KB in every pattern (a V2-Lite FP8W gate/up tile: 128 rows of 2 KB).
  const Pattern contig{1, 256 << 10, 32 << 10, 1};
  const Pattern fp8w{128, 2048, 256, 1};  // 32 KB stages
  const Pattern w4{128, 2048, 128, 1};    // 16 KB stages
  for (int occ : {1, 2, 3, 4}) {
    run_case<2>(b, "contiguous 32 KB stages", contig, occ, sms);
    run_case<3>(b, "contiguous 32 KB stages", contig, occ, sms);
    run_case<4>(b, "contiguous 32 KB stages", contig, occ, sms);
  }
  for (int occ : {1, 2, 3}) {
    run_case<2>(b, "128 rows x 256 B (FP8W)", fp8w, occ, sms);
    run_case<3>(b, "128 rows x 256 B (FP8W)", fp8w, occ, sms);
    run_case<4>(b, "128 rows x 256 B (FP8W)", fp8w, occ, sms);
  }
  for (int occ : {2, 3, 4}) {
    run_case<3>(b, "128 rows x 128 B (W4A16)", w4, occ, sms);
    run_case<4>(b, "128 rows x 128 B (W4A16)", w4, occ, sms);
  }
  // W1f's gate/up launch: ~37 experts x 22 blocks = 814 CTAs of 256 KB (3.08 waves at two an
  // SM), against whole waves, with a stage's products stood in for by a spin of so many cycles.
  for (int64_t blocks : {int64_t(814), int64_t(792), int64_t(2048)})
    for (int spin : {0, 1000, 2000, 4000}) {
      Pattern p = fp8w;
      p.spin = spin;
      char name[64];
      std::snprintf(name, sizeof(name), "FP8W rows, %lld blocks", static_cast<long long>(blocks));
      run_case<2>(b, name, p, 2, sms, blocks);
      if (spin >= 2000) run_case<3>(b, name, p, 2, sms, blocks);
    }
  // DeepSeek-V2.5's W4A16 experts: a row is K / 2 bytes of codes, then a BF16 scale a group,
  // padded to 16 bytes as stored before f1fd85b, so gate/up's rows (K = 5120) are 2,640 bytes apart
  // and down's (K = 1536) 800, neither a multiple of 128: most rows' 128-byte stage chunks
  // straddle two L2 lines. Against the same codes in rows padded to 128 bytes, and in rows of
  // codes alone.
  for (const auto& [name, row, padded, codes] : {std::tuple{"V2.5 gate/up rows", 2640, 2688, 2560},
                                                 std::tuple{"V2.5 down rows", 800, 896, 768}})
    for (int occ : {3, 4}) {
      char label[64];
      for (const auto& [what, stride] : {std::pair{"as stored", row}, std::pair{"padded", padded},
                                         std::pair{"codes only", codes}}) {
        std::snprintf(label, sizeof(label), "%s, %s", name, what);
        Pattern p{128, stride, 128, 1, 0, codes};
        run_case<3>(b, label, p, occ, sms);
      }
    }
  // Longer runs of each row a stage, the same 16 KB stage: a stage's 128-byte chunk of each of
  // 128 rows (the W4A16 decode stage) against 256 bytes of 64 rows and 512 of 32, on V2.5's
  // padded expert rows, with and without a spin standing in for a stage's products. 128 x 256
  // bytes in two 32 KB stages for scale (the same bytes in flight a CTA).
  for (const auto& [name, stride, codes] :
       {std::tuple{"V2.5 gate/up", 2688, 2560}, std::tuple{"V2.5 down", 896, 768}})
    for (int spin : {0, 2000})
      for (const auto& [rows, chunk] :
           {std::pair{128, 128}, std::pair{64, 256}, std::pair{32, 512}, std::pair{128, 256}}) {
        if (codes % chunk != 0) continue;
        char label[64];
        std::snprintf(label, sizeof(label), "%s, %d rows x %d B", name, rows, chunk);
        Pattern p{rows, stride, chunk, 1, spin, codes};
        if (rows * chunk > (16 << 10))
          run_case<2>(b, label, p, 3, sms);
        else
          run_case<3>(b, label, p, 3, sms);
      }
  // One wave of CTAs, each streaming several blocks with one pipeline.
  for (int jobs : {2, 4, 8}) {
    Pattern p = fp8w;
    p.jobs = jobs;
    run_case<2>(b, "128 rows x 256 B (FP8W), jobs", p, 2, sms);
    run_case<3>(b, "128 rows x 256 B (FP8W), jobs", p, 2, sms);
    Pattern q = w4;
    q.jobs = jobs;
    run_case<3>(b, "128 rows x 128 B (W4A16), jobs", q, 3, sms);
  }
}

}  // namespace
}  // namespace ds
