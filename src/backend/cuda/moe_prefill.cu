// Prefill-path experts: tokens gathered per expert into contiguous BF16 rows, then cuBLAS
// tensor-core GEMMs for every touched expert (gate and up into one F32 [n, 2F] block, SiLU
// and multiply to BF16, down into F32), experts spread over side streams so several run at
// once; quantized experts are expanded to BF16 beside them (run_streams). Reads the
// per-expert counts to the host once.
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_dequant.cuh"
#include "backend/cuda/wq_kernel.cuh"
#include "core/error.h"

namespace ds::cuda::moe {
namespace {

constexpr int kThreads = 256;

// act[p, :] = x[sorted_token[p], :] as the kernels of format F stage it (wq_kernel.cuh's
// staged_col and act_bits: BF16, W4A16's chunk order, FP8W's FP16); one block per sorted
// position below *assigned (sorted_token null: row p of x; assigned null: every block).
// batched (DEEPSERVE_ROW_REGS=1): the count and the row's token load together (sorted_token has a
// slot for every block), then a thread's elements kGatherBatch at a time; the loop form is a
// chain of round trips (the count, the token, then 1 and 4 elements at a time in SASS).
constexpr int kGatherBatch = 8;
template <WqFormat F>
__global__ void gather_act_kernel(const float* __restrict__ x, int64_t x_stride,
                                  const int* __restrict__ sorted_token,
                                  const int* __restrict__ assigned, int hidden,
                                  uint16_t* __restrict__ act, bool batched) {
  pdl::enter();
  const int64_t p = blockIdx.x;
  uint16_t* dst = act + p * hidden;
  if (batched) {
    const int count = assigned ? *assigned : INT_MAX;
    const int64_t tok = sorted_token ? int64_t(sorted_token[p]) : p;
    if (p >= count) return;
    const float* src = x + tok * x_stride;
    for (int k0 = int(threadIdx.x); k0 < hidden; k0 += kGatherBatch * kThreads) {
      float v[kGatherBatch];
#pragma unroll
      for (int b = 0; b < kGatherBatch; ++b) {
        const int k = k0 + b * kThreads;
        v[b] = k < hidden ? src[k] : 0.0f;
      }
#pragma unroll
      for (int b = 0; b < kGatherBatch; ++b) {
        const int k = k0 + b * kThreads;
        if (k < hidden) dst[wqk::staged_col<F>(k)] = wqk::act_bits<F>(v[b]);
      }
    }
    return;
  }
  if (assigned && p >= *assigned) return;
  const float* src = x + (sorted_token ? int64_t(sorted_token[p]) : p) * x_stride;
  for (int k = threadIdx.x; k < hidden; k += kThreads)
    dst[wqk::staged_col<F>(k)] = wqk::act_bits<F>(src[k]);
}

// act[p, f] = bf16(silu(gu[p, f]) * gu[p, F + f]) for the rows p = begin + blockIdx.x.
__global__ void silu_mul_bf16_kernel(const float* __restrict__ gu, int64_t ld_gu, int F, int begin,
                                     __nv_bfloat16* __restrict__ act) {
  pdl::enter();
  const int64_t p = begin + int64_t(blockIdx.x);
  const float* g = gu + p * ld_gu;
  __nv_bfloat16* dst = act + p * F;
  for (int f = threadIdx.x; f < F; f += kThreads) {
    const float v = g[f];
    dst[f] = __float2bfloat16_rn(v / (1.0f + expf(-v)) * g[F + f]);
  }
}

// Row-major C[n, m] = B[n, k] * A[m, k]^T (row strides ldc, ldb, lda in elements): in cuBLAS's
// column-major terms C^T (m x n) = op_T(A) (m x k) * B^T (k x n).
void gemm_bf16(cublasHandle_t h, int m, int n, int k, const void* A, int64_t lda, const void* B,
               int64_t ldb, float* C, int64_t ldc) {
  const float one = 1.0f;
  const float zero = 0.0f;
  check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A, CUDA_R_16BF, int(lda), B,
                     CUDA_R_16BF, int(ldb), &zero, C, CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "gemm");
}

}  // namespace

void launch_gather_act(const float* x, int64_t x_stride, const int* sorted_token,
                       const int* assigned, int64_t n, int hidden, void* act, cudaStream_t stream,
                       WqFormat as) {
  if (n == 0) return;
  DS_CHECK(!wq_w4(as) || hidden % 8 == 0, "gather: W4A16 order needs whole 8-column chunks");
  auto* dst = static_cast<uint16_t*>(act);
  const auto kernel = as == WqFormat::W4A16  ? gather_act_kernel<WqFormat::W4A16>
                      : as == WqFormat::FP8W ? gather_act_kernel<WqFormat::FP8W>
                                             : gather_act_kernel<WqFormat::BF16>;
  const bool batched = g_row_regs.on();
  if (batched) note_row_regs_launch();
  pdl::launch(kernel, unsigned(n), kThreads, 0, stream, x, x_stride, sorted_token, assigned, hidden,
              dst, batched);
  check(cudaGetLastError(), "gather");
}

namespace {

// Gate and up rows stored back to back with one stride: one GEMM of 2F rows covers both.
bool gate_up_stacked(const ExpertPtrs& ex, int F) {
  return ex.gate_ld == ex.up_ld &&
         static_cast<const char*>(ex.up) ==
             static_cast<const char*>(ex.gate) + int64_t(F) * ex.gate_ld * 2;
}

// Where quantized experts' expansions go: chunks of per_chunk experts in the GEMMs' order;
// chunk c in slots c * per_chunk .. (every chunk its own: ring 0), or in (c % ring) * per_chunk
// .. (a ring of `ring` whole chunks, when the slots hold fewer than the touched experts).
struct ExpandPlan {
  int per_chunk = 1;
  int chunks = 0;
  int ring = 0;
  int64_t slot_of(int j) const {
    const int c = j / per_chunk;
    return int64_t(ring > 0 ? c % ring : c) * per_chunk + j % per_chunk;
  }
};

ExpandPlan expand_plan(int n_order, int64_t slots) {
  ExpandPlan p;
  p.per_chunk = int(moe_wq_chunk_experts(n_order, kExpandChunks));
  p.chunks = (n_order + p.per_chunk - 1) / p.per_chunk;
  if (slots < n_order) {
    p.ring = int(slots / p.per_chunk);
    DS_CHECK(p.ring >= 2, "moe prefill: the expansion ring needs two chunks");
  }
  return p;
}

// One expert's GEMMs fill a fraction of the GPU (~1,000 tokens x F = 1,408 is ~50-90 tiles
// for 132 SMs), so experts run concurrently: the largest first, each onto the side stream with
// the least work queued (all of an expert's GEMMs and its SiLU on one stream, so it needs no
// other synchronization; the rows it touches are its own). Quantized experts: the calling
// stream expands them in chunks of that order after the fork (memory-bound, beside the
// GEMMs), and a side stream waits for a chunk's event before its first expert of the chunk.
// In a ring (xp.ring > 0), chunk c + ring is expanded into chunk c's slots after the calling
// stream has waited for every side stream to get past chunk c's GEMMs.
void run_streams(const PrefillFfnArgs& a, const std::vector<int>& offsets,
                 const std::vector<int>& order, int S, const ExpandPlan& xp, cudaStream_t stream) {
  const int H = a.hidden, F = a.inter;
  const auto* xg = static_cast<const __nv_bfloat16*>(a.xg);
  auto* act = static_cast<__nv_bfloat16*>(a.act);
  check(cudaEventRecord(a.events[0], stream), "fork record");
  for (int i = 0; i < S; ++i) check(cudaStreamWaitEvent(a.streams[i], a.events[0]), "fork wait");
  const int n_order = int(order.size());
  const int per_chunk = xp.per_chunk;
  DS_CHECK(!a.wslots || (per_chunk <= kWqDequantMaxExperts && xp.chunks <= kExpandChunks),
           "moe prefill: too many experts");
  const auto expand = [&](int c) {
    const int first = c * per_chunk, count = std::min(per_chunk, n_order - first);
    auto* slots = static_cast<__nv_bfloat16*>(a.wslots) + xp.slot_of(first) * 3 * F * H;
    launch_wq_dequant_experts(a.wdtype, a.experts_device, order.data() + first, count, H, F, slots,
                              stream);
    check(cudaEventRecord(a.expand_events[c], stream), "expand record");
  };
  if (a.wslots)
    for (int c = 0; c < (xp.ring > 0 ? std::min(xp.ring, xp.chunks) : xp.chunks); ++c) expand(c);
  std::array<int64_t, kPrefillStreams> load{};
  std::array<int, kPrefillStreams> waited{};  // expansion chunks each side stream waited for
  for (int j = 0; j < n_order; ++j) {
    const int e = order[size_t(j)];
    const int i = int(std::min_element(load.begin(), load.begin() + S) - load.begin());
    const int begin = offsets[size_t(e)];
    const int count = offsets[size_t(e) + 1] - begin;
    load[size_t(i)] += count;
    if (a.wslots && waited[size_t(i)] <= j / per_chunk) {
      check(cudaStreamWaitEvent(a.streams[i], a.expand_events[j / per_chunk]), "expand wait");
      waited[size_t(i)] = j / per_chunk + 1;
    }
    const ExpertPtrs& ex = a.experts[e];
    const cublasHandle_t h = a.cublas[i];
    const __nv_bfloat16* xe = xg + int64_t(begin) * H;
    float* gu = a.gu + int64_t(begin) * a.ld_gu;
    if (gate_up_stacked(ex, F)) {
      gemm_bf16(h, 2 * F, count, H, ex.gate, ex.gate_ld, xe, H, gu, a.ld_gu);
    } else {
      gemm_bf16(h, F, count, H, ex.gate, ex.gate_ld, xe, H, gu, a.ld_gu);
      gemm_bf16(h, F, count, H, ex.up, ex.up_ld, xe, H, gu + F, a.ld_gu);
    }
    pdl::launch(silu_mul_bf16_kernel, unsigned(count), kThreads, 0, a.streams[i], a.gu, a.ld_gu, F,
                begin, act);
    gemm_bf16(h, H, count, F, ex.down, ex.down_ld, act + int64_t(begin) * F, F, gu, a.ld_gu);
    // The last expert of chunk c in a ring: chunk c + ring goes into its slots once every side
    // stream is past it (the join events, recorded again at the end).
    const int c = j / per_chunk;
    if (a.wslots && xp.ring > 0 && (j + 1 == n_order || (j + 1) % per_chunk == 0) &&
        c + xp.ring < xp.chunks) {
      for (int q = 0; q < S; ++q) {
        check(cudaEventRecord(a.events[size_t(q) + 1], a.streams[q]), "ring record");
        check(cudaStreamWaitEvent(stream, a.events[size_t(q) + 1]), "ring wait");
      }
      expand(c + xp.ring);
    }
  }
  for (int i = 0; i < S; ++i) {
    check(cudaEventRecord(a.events[size_t(i) + 1], a.streams[i]), "join record");
    check(cudaStreamWaitEvent(stream, a.events[size_t(i) + 1]), "join wait");
  }
}

}  // namespace

int prefill_streams() {
  static const int n = [] {
    const char* v = std::getenv("DEEPSERVE_MOE_STREAMS");
    const int k = v ? std::atoi(v) : 0;
    return k >= 1 && k <= kPrefillStreams ? k : 4;
  }();
  return n;
}

void run_prefill_ffn(const PrefillFfnArgs& a, cudaStream_t stream) {
  const int64_t n = a.num_tokens * a.top_k;
  const int E = a.num_experts;
  const int H = a.hidden;
  const int F = a.inter;
  auto* xg = static_cast<__nv_bfloat16*>(a.xg);

  // Gather first (positions past the last valid one exit), then read the counts.
  launch_gather_act(a.x, a.x_stride, a.lists.sorted_token, a.lists.offsets + E, n, H, xg, stream);
  std::vector<int> offsets(size_t(E) + 1);
  check(cudaMemcpyAsync(offsets.data(), a.lists.offsets, offsets.size() * sizeof(int),
                        cudaMemcpyDeviceToHost, stream),
        "offsets download");
  check(cudaStreamSynchronize(stream), "offsets sync");
  // DEEPSERVE_MOE_PREFILL_TIMING=1: per call, the host time to enqueue the experts' work and
  // the GPU time from the fork to the join (diagnostics for the prefill path's speed).
  const bool timing = g_moe_prefill_timing.on();
  const auto host0 = std::chrono::steady_clock::now();
  const int64_t assigned = offsets[size_t(E)];
  DS_CHECK(assigned >= 0 && assigned <= n, "moe_ffn: bad expert offsets");

  // Touched experts, the largest first.
  std::vector<int> order;
  for (int e = 0; e < E; ++e)
    if (offsets[size_t(e) + 1] > offsets[size_t(e)]) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return offsets[size_t(x) + 1] - offsets[size_t(x)] >
           offsets[size_t(y) + 1] - offsets[size_t(y)];
  });
  const int S = std::min<int>(std::clamp(a.num_streams, 1, kPrefillStreams), int(order.size()));
  if (S == 0) return;
  // Quantized experts: the GEMMs read their BF16 expansions (made in run_streams), expert
  // order[j] from slot xp.slot_of(j).
  const ExpandPlan xp = a.wslots ? expand_plan(int(order.size()), a.wslot_count) : ExpandPlan{};
  std::vector<ExpertPtrs> expanded;
  PrefillFfnArgs args = a;
  if (a.wslots) {
    expanded.assign(size_t(E), ExpertPtrs{});
    auto* base = static_cast<__nv_bfloat16*>(a.wslots);
    for (int j = 0; j < int(order.size()); ++j) {
      const __nv_bfloat16* g = base + xp.slot_of(j) * 3 * F * H;
      expanded[size_t(order[size_t(j)])] = {g, g + int64_t(F) * H, g + 2 * int64_t(F) * H, H, H, F};
    }
    args.experts = expanded.data();
  }
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  if (timing) {
    check(cudaEventCreate(&t0), "timing event");
    check(cudaEventCreate(&t1), "timing event");
    check(cudaEventRecord(t0, stream), "timing record");
  }
  run_streams(args, offsets, order, S, xp, stream);
  if (timing) {
    const double host_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host0).count();
    check(cudaEventRecord(t1, stream), "timing record");
    check(cudaEventSynchronize(t1), "timing sync");
    float gpu_ms = 0;
    check(cudaEventElapsedTime(&gpu_ms, t0, t1), "timing elapsed");
    std::fprintf(stderr,
                 "moe prefill: %lld assignments, %zu experts, %d streams: enqueue %.0f us, "
                 "experts on the GPU %.0f us (%.1f TFLOP/s)\n",
                 static_cast<long long>(assigned), order.size(), S, host_us, gpu_ms * 1e3,
                 2.0 * double(assigned) * 3.0 * H * F / (gpu_ms * 1e-3) / 1e12);
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
  }
}

}  // namespace ds::cuda::moe
