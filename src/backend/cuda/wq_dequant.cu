// BF16 expansion of quantized weights (wq_dequant.cuh): one thread per 8-element chunk of a
// row, one 16-byte store each.
#include "backend/cuda/wq_dequant.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_kernel.cuh"
#include "backend/fp8w.h"
#include "backend/w4a16.h"
#include "core/error.h"

namespace ds::cuda {
namespace {

constexpr int kThreads = 256;

struct Jobs {
  WqDequantJob job[kWqDequantMaxJobs];
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Expands rows [0, j.rows) of job j, chunks from `first` in steps of `step`.
template <bool W4>
__device__ void expand_rows(const WqDequantJob& j, int64_t first, int64_t step) {
  const int64_t per_row = j.k / 8, total = j.rows * per_row;
  for (int64_t c = first; c < total; c += step) {
    const int64_t r = c / per_row, k0 = (c - r * per_row) * 8;
    const uint8_t* row = static_cast<const uint8_t*>(j.w) + r * j.w_stride;
    float v[8];
    if constexpr (W4) {
      // Eight codes, element e in nibble e; one BF16 scale per 128-group.
      const uint32_t word = *reinterpret_cast<const uint32_t*>(row + k0 / 2);
      const int64_t g = k0 / w4a16::kGroup;
      const float s = w4a16::from_bf16(
          *reinterpret_cast<const uint16_t*>(row + w4a16::code_bytes(j.k) + 2 * g));
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = w4a16::mul_rn(float(int((word >> (4 * e)) & 15u) - 8), s);
    } else {
      // Eight e4m3 codes (exact in half), one F32 scale per 128-group.
      const uint2 codes = *reinterpret_cast<const uint2*>(row + k0);
      const float s = fp8w::scale(row, j.k, k0 / fp8w::kGroup);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t w = q < 2 ? codes.x : codes.y;
        const float2 f = wqk::e4m3x2_to_float2(w >> (16 * (q & 1)));
        v[2 * q] = __fmul_rn(f.x, s);
        v[2 * q + 1] = __fmul_rn(f.y, s);
      }
    }
    uint4 o;
    o.x = pack_bf16(v[0], v[1]);
    o.y = pack_bf16(v[2], v[3]);
    o.z = pack_bf16(v[4], v[5]);
    o.w = pack_bf16(v[6], v[7]);
    *reinterpret_cast<uint4*>(static_cast<uint8_t*>(j.out) + (r * j.k + k0) * 2) = o;
  }
}

// Grid (chunks of the largest job / kThreads, jobs).
template <bool W4>
__global__ void __launch_bounds__(kThreads) dequant_kernel(Jobs jobs) {
  pdl::enter();
  expand_rows<W4>(jobs.job[blockIdx.y], int64_t(blockIdx.x) * kThreads + threadIdx.x,
                  int64_t(gridDim.x) * kThreads);
}

struct ExpertIds {
  int id[kWqDequantMaxExperts];
};

// Grid (chunks, experts, 3): matrix z (gate, up, down) of expert ids.id[y] into slot y,
// out + y * 3FH.
template <bool W4>
__global__ void __launch_bounds__(kThreads)
    dequant_experts_kernel(const moe::ExpertPtrs* experts, ExpertIds ids, int64_t H, int64_t F,
                           void* out) {
  pdl::enter();
  const int e = ids.id[blockIdx.y];
  const moe::ExpertPtrs ex = experts[e];
  const int z = int(blockIdx.z);
  auto* base = static_cast<__nv_bfloat16*>(out) + int64_t(blockIdx.y) * 3 * F * H;
  WqDequantJob j;
  j.w = z == 0 ? ex.gate : z == 1 ? ex.up : ex.down;
  j.w_stride = z == 0 ? ex.gate_ld : z == 1 ? ex.up_ld : ex.down_ld;  // bytes (packed formats)
  j.rows = z == 2 ? H : F;
  j.k = z == 2 ? F : H;
  j.out = base + int64_t(z) * F * H;
  expand_rows<W4>(j, int64_t(blockIdx.x) * kThreads + threadIdx.x, int64_t(gridDim.x) * kThreads);
}

// Enough blocks to fill the GPU several times over, each thread then taking a few chunks.
unsigned expand_blocks(int64_t chunks) {
  return unsigned(std::min<int64_t>((chunks + kThreads - 1) / kThreads, 4096));
}

}  // namespace

bool wq_dequant_fits(DType t, int64_t k) {
  return (t == DType::W4A16 && k % w4a16::kGroup == 0) || (t == DType::FP8W && k % 8 == 0);
}

void launch_wq_dequant(DType t, const WqDequantJob* jobs, int num_jobs, cudaStream_t stream) {
  DS_CHECK(num_jobs >= 1 && num_jobs <= kWqDequantMaxJobs, "wq dequant: 1 to 3 matrices");
  DS_CHECK(t == DType::W4A16 || t == DType::FP8W, "wq dequant: W4A16 or FP8W weights");
  Jobs a{};
  int64_t most = 0;
  for (int i = 0; i < num_jobs; ++i) {
    const WqDequantJob& j = jobs[i];
    DS_CHECK(wq_dequant_fits(t, j.k) && j.rows >= 0, "wq dequant: K must be whole 8-chunks");
    DS_CHECK(j.w_stride == (t == DType::W4A16 ? w4a16::row_stride(j.k) : fp8w::row_stride(j.k)),
             "wq dequant: rows must be packed");
    DS_CHECK(
        reinterpret_cast<uintptr_t>(j.w) % 16 == 0 && reinterpret_cast<uintptr_t>(j.out) % 16 == 0,
        "wq dequant: 16-byte aligned weights and output");
    a.job[i] = j;
    most = std::max(most, j.rows * (j.k / 8));
  }
  if (most == 0) return;
  const dim3 grid(expand_blocks(most), unsigned(num_jobs));
  if (t == DType::W4A16)
    pdl::launch(dequant_kernel<true>, grid, kThreads, 0, stream, a);
  else
    pdl::launch(dequant_kernel<false>, grid, kThreads, 0, stream, a);
  check_cuda(cudaGetLastError(), "wq dequant launch");
}

void launch_wq_dequant_experts(DType t, const moe::ExpertPtrs* experts, const int* ids, int n,
                               int64_t hidden, int64_t inter, void* out, cudaStream_t stream) {
  DS_CHECK(t == DType::W4A16 || t == DType::FP8W, "wq dequant: W4A16 or FP8W experts");
  DS_CHECK(wq_dequant_fits(t, hidden) && wq_dequant_fits(t, inter),
           "wq dequant: expert dims must be whole 8-chunks");
  DS_CHECK(reinterpret_cast<uintptr_t>(out) % 16 == 0, "wq dequant: 16-byte aligned output");
  DS_CHECK(n >= 0 && n <= kWqDequantMaxExperts, "wq dequant: too many experts in one launch");
  if (n == 0) return;
  ExpertIds list{};
  std::copy(ids, ids + n, list.id);
  const dim3 grid(expand_blocks(hidden * inter / 8), unsigned(n), 3);
  if (t == DType::W4A16)
    pdl::launch(dequant_experts_kernel<true>, grid, kThreads, 0, stream, experts, list, hidden,
                inter, out);
  else
    pdl::launch(dequant_experts_kernel<false>, grid, kThreads, 0, stream, experts, list, hidden,
                inter, out);
  check_cuda(cudaGetLastError(), "wq dequant experts launch");
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "capture status");
  return status != cudaStreamCaptureStatusNone;
}

bool wq_dequant_dense(int64_t rows, const TensorView& w, cudaStream_t stream) {
  return g_wq_dequant.on() && rows >= g_wq_dequant_min_rows.get() && w.ndim == 2 &&
         wq_dequant_fits(w.dtype, w.cols()) && !stream_capturing(stream);
}

int64_t moe_wq_expand_max_bytes() {
  const long long mb = g_moe_wq_expand_max_mb.get();
  return mb > 0 ? int64_t(mb) << 20 : kMoeWqExpandMaxBytes;
}

int64_t moe_wq_expand_slots(int num_experts, int64_t hidden, int64_t inter, int chunks) {
  const int64_t expert = 3 * hidden * inter * 2, cap = moe_wq_expand_max_bytes();
  if (num_experts <= 0 || expert <= 0) return 0;
  if (int64_t(num_experts) * expert <= cap) return num_experts;
  const int64_t per_chunk = moe_wq_chunk_experts(num_experts, chunks);
  const int64_t ring = cap / (per_chunk * expert);
  return ring >= 2 ? ring * per_chunk : 0;
}

int64_t moe_wq_slots_within(int64_t slots, int64_t per_chunk, size_t room,
                            const std::function<size_t(int64_t)>& bytes_for) {
  if (slots <= 0 || bytes_for(slots) <= room) return slots;
  if (per_chunk <= 0) return 0;
  int64_t s = slots / per_chunk * per_chunk;
  if (s == slots) s -= per_chunk;
  for (; s >= 2 * per_chunk; s -= per_chunk)
    if (bytes_for(s) <= room) return s;
  return 0;
}

bool wq_dequant_moe(int64_t assignments, int num_experts, DType t, int64_t hidden, int64_t inter,
                    int chunks, cudaStream_t stream) {
  return g_wq_dequant.on() && num_experts > 0 &&
         assignments >= g_moe_wq_dequant_min.get() * num_experts && wq_dequant_fits(t, hidden) &&
         wq_dequant_fits(t, inter) && moe_wq_expand_slots(num_experts, hidden, inter, chunks) > 0 &&
         !stream_capturing(stream);
}

}  // namespace ds::cuda
